"""``snakellm import-hf``: a Hugging Face GPT-2/Llama directory -> a snakellm run (see snakellm.export.hf)."""

from snakellm.export.hf import main_import as main

__all__ = ["main"]
