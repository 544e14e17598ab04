"""``snakellm import-nemo``: see :mod:`snakellm.export.nemo`."""

from snakellm.export.nemo import main_import as main

__all__ = ["main"]
