"""batchspec's version, the one place it is written: ``pyproject.toml`` reads it from here, and
the modules that record it (a run's metadata, auto's record, a model card) import it from here
rather than from the ``batchspec`` facade above them."""

__version__ = "0.1.0"
