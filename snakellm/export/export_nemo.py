"""``snakellm export-nemo``: see :mod:`snakellm.export.nemo`."""

from snakellm.export.nemo import main_export as main

__all__ = ["main"]
