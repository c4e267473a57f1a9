"""The k1:k2 grid tests: one package, so its fixtures (conftest.py) are shared across files."""
