#!/usr/bin/env bash
# The main job: the whole default workflow on the shipped corpus, on CPU.
# Extra arguments go to snakemake (e.g. a target, -n, --forceall).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# Graphviz draws the DAG pictures of the report where it can be installed (apt, once; instant
# afterwards); without it `snakellm dag` draws them itself, so the run goes on either way
bash scripts/setup-report-tools.sh || echo "run.sh: no Graphviz; the DAG pictures are drawn by snakellm's own renderer" >&2
export PATH="$PWD/.venv/bin:$PATH"
# Snakemake picks up profiles/default itself (the workflow-specific profile): naming it too made it
# report the profile twice
exec snakemake "$@"
