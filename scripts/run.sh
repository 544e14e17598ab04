#!/usr/bin/env bash
# The main job: the whole default workflow on the shipped corpus, on CPU.
# Extra arguments go to snakemake (e.g. a target, -n, --forceall).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# Graphviz draws the DAG pictures of the report (apt, once; instant afterwards)
bash scripts/setup-report-tools.sh
export PATH="$PWD/.venv/bin:$PATH"
exec snakemake --profile profiles/default "$@"
