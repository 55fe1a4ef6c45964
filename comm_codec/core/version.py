"""The package version, in a leaf module: the command line reads it without importing torch."""

__all__ = ["__version__"]

__version__ = "0.1.0"
