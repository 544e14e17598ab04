#!/usr/bin/env bash
# The test suite: unit tests and real end-to-end Snakemake runs.
# Extra arguments go to pytest (e.g. -k download, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
exec python -m pytest "$@"
