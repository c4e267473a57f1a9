"""transformers checkpoints in and out (`python -m moejax.hf import|export`): `families`,
`hfconfig`, `tensors`, `importer`, `exporter`, `runstate`. Imports everything up to `training`
(not `kgrid`, `aot` or the entry points)."""
