"""The package's version, where every layer can read it (the package root re-exports it)."""

__version__ = "0.1.0"
