"""The one C extension (everything else is in pyproject.toml): the columnar chunk's jsonl writer.

``snakellm/data/_jsonl.c`` (see snakellm/data/columnar_jsonl.py) is optional: an install without a C compiler
still works, and the chunk stage then writes the same bytes through orjson (docs/benchmarks.md: slower on
parquet and Arrow sources).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("snakellm.data._jsonl", ["snakellm/data/_jsonl.c"], optional=True, extra_compile_args=["-O3"])
    ]
)
