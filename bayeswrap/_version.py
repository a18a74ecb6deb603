"""The package version (one place; read by the package and by run folders)."""

__version__ = "0.1.0"
