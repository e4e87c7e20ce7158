"""The package's version (``deepoffload.__version__``)."""

__version__ = "0.1.0"
