"""Dispatch: expert plans (dropless, capacity) and the kernels that run them, by name
(`registry.KERNELS`, each kernel's module imported when a program using it is traced).
Imports only moejax's base modules (errors, platforms, sharding)."""
