"""transformers checkpoints in and out (`python -m moejax.hf import|export`): `families`,
`hfconfig`, `tensors`, `importer`, `exporter`, `runstate`. May import every layer below it,
`kgrid` included (today it uses up to `training`); not `aot` or the entry points."""
