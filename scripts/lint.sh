#!/usr/bin/env bash
# Lint and type checks, as CI runs them before the tests (each must report nothing):
# ruff (lint + format), mypy, snakefmt, snakemake --lint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
status=0
step() { echo "lint: $*" >&2; "$@" || status=1; }
step ruff check snakellm tests scripts
step ruff format --check snakellm tests scripts
step mypy
step snakefmt --check Snakefile rules
# snakemake --lint prints its findings and exits 0: any "Lints for" line is a failure
lints=$(snakemake --lint --configfile config/config.yaml 2>&1 | grep -A3 "^Lints for" || true)
if [ -n "$lints" ]; then echo "$lints" >&2; echo "lint: snakemake --lint found problems" >&2; status=1; fi
exit $status
