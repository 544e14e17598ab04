"""snakellm: a Snakemake build system for LLM data and training.

Every workflow rule calls one ``snakellm <step>`` command; the code behind each
step lives in a small module named for what it does.
"""

__version__ = "0.1.0"
