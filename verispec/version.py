"""The package version (one place: the CLI, the records and the package face read it)."""

__version__ = "0.2.0"
