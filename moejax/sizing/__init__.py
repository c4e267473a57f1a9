"""What a config costs without running it: the parameter worksheet and model FLOPs (MFU).
Imports the base modules, `kernels`, `nn`, `data`, `build` and `config`."""
