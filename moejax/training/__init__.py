"""Training: the jitted step, optimizer, checkpoints, the run directory, the loop and the
trainer. Imports everything below it (base, kernels, nn, data, build, config, sizing)."""
