"""moejax: mixture-of-experts LMs trained under different router merge rules."""

__version__ = "0.1.0"
