#!/usr/bin/env bash
# Create .venv (if needed) and install snakellm with everything it needs.
# Idempotent and quick when nothing changed; reinstalls when pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.snakellm-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "bootstrap: installing into .venv (first run takes a few minutes; log: .venv/bootstrap.log)" >&2
  log=.venv/bootstrap.log
  {
    .venv/bin/python -m pip install --upgrade pip &&
    # torch first and pinned: the CPU build that lies on these machines. Any other
    # version pulls several GB of CUDA packages. Override with TORCH_SPEC on a GPU box.
    .venv/bin/python -m pip install "${TORCH_SPEC:-torch==2.13.0}" &&
    .venv/bin/python -m pip install -e ".[test,lint,tracking]" &&
    .venv/bin/python -W ignore -c "import snakellm, snakemake, torch, megatron.core"
  } >"$log" 2>&1 || { tail -n 40 "$log" >&2; echo "bootstrap: install failed (see $log)" >&2; exit 1; }
  touch "$stamp"
fi
