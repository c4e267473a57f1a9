"""The model: merge rules (`routing`), the MoE block, attention, layers, the Transformer and
the losses on its router outputs. Imports the base modules and `moejax.kernels`."""
