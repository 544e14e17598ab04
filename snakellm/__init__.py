"""snakellm: a Snakemake build system for LLM data and training.

Every workflow rule calls one ``snakellm <step>`` command; the code behind each
step lives in a small module named for what it does.
"""

from snakellm import _imports

__version__ = "0.1.0"

_imports.install()  # megatron-core without its unused wandb import (see snakellm._imports)
