#!/usr/bin/env bash
# The test suite: unit tests and real end-to-end Snakemake runs.
# Extra arguments go to pytest (e.g. -k download, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# Graphviz + Chromium for the DAG pictures and the report's browser test (apt, once; ~0 s after)
bash scripts/setup-report-tools.sh || echo "test.sh: report tools missing; the DAG/report browser tests will skip" >&2
export PATH="$PWD/.venv/bin:$PATH"
exec python -m pytest "$@"
