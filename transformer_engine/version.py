"""The package version; setup.py reads it from here without importing torch."""

__version__ = "0.1.0"
