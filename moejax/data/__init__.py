"""Data: document sources (`corpora`), tokenizers, and the grain pipeline (`pipeline`).
Imports only moejax's base modules (errors, runio, distributed)."""
