"""Dispatch: expert plans (dropless, capacity) and the kernels that run them, by name
(`dispatch.KERNELS`). Imports only moejax's base modules (errors, sharding)."""
