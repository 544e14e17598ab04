#!/usr/bin/env bash
# Create .nemo-venv: NeMo 2.4.1 (the last release with NeMo-1's MegatronGPTModel) on CPU, isolated from
# .venv, for tests/test_nemo_compat.py (NeMo's own loader reading our .nemo files, and writing one we import).
#
# torch 2.13.0 (the same CPU build as .venv; override with TORCH_SPEC), megatron-core 0.16.1, and
# nemo_toolkit==2.4.1 --no-deps plus exactly the packages its import needs (scripts/nemo-env-requirements.txt,
# all --no-deps and pinned: NeMo's [nlp] extra would pull CUDA builds, bitsandbytes, modelopt ...).
#
# Built once per machine: the venv lives in a cache outside the clone,
# ${SNAKELLM_CACHE:-~/.cache/snakellm}/nemo-env-<key>, where <key> hashes its inputs (this script, the
# requirements, the Python version, TORCH_SPEC), and .nemo-venv in the clone is a link to it. A fresh clone
# on the same machine (CI) links the cached venv at once; a changed input builds a new one; a new machine
# builds it (about 1.7 GB; a few minutes). NEMO_VENV=DIR builds into DIR itself instead (no cache, no link).
set -euo pipefail
cd "$(dirname "$0")/.."
REQ=scripts/nemo-env-requirements.txt
PY=${PYTHON:-python3}
want=$({ cat "$0" "$REQ"; "$PY" -c 'import sys; print(sys.version)'; echo "${TORCH_SPEC:-}"; } | sha256sum | cut -c1-16)
if [ -n "${NEMO_VENV:-}" ]; then
  VENV=$NEMO_VENV; LINK=""
else
  CACHE=${SNAKELLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/snakellm}
  VENV=$CACHE/nemo-env-$want; LINK=.nemo-venv
fi
stamp="$VENV/.snakellm-nemo-env"
ready() { [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; }
link() {  # .nemo-venv -> the cached venv (replacing an old link or an old in-clone venv)
  [ -z "$LINK" ] && return 0
  [ "$(readlink "$LINK" 2>/dev/null)" = "$VENV" ] && return 0
  rm -rf "$LINK"; ln -s "$VENV" "$LINK"
}
if ready; then link; exit 0; fi
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9  # two test sessions (or two clones) starting at once build it once
if ready; then link; exit 0; fi
start=$(date +%s)
echo "setup-nemo-env: creating $VENV (NeMo 2.4.1 on CPU; log: $VENV.log)" >&2
rm -rf "$VENV"
log="$VENV.log"
{
  "$PY" -m venv "$VENV" &&
  "$VENV/bin/python" -m pip install "${TORCH_SPEC:-torch==2.13.0}" &&
  "$VENV/bin/python" -m pip install --no-deps -r "$REQ" &&
  # the import the test needs, with the probe's import-time shims (tests/nemo_probe.py says why)
  NVIDIA_PYTORCH_VERSION=24.07 "$VENV/bin/python" -W ignore -c '
import sys, types
import megatron.core.parallel_state as ps
ps.set_pipeline_model_parallel_split_rank = getattr(ps, "set_pipeline_model_parallel_split_rank", lambda *a: None)
sys.modules["megatron.core.dist_checkpointing.strategies.tensorstore"] = types.ModuleType("tensorstore")
from nemo.collections.nlp.models.language_modeling.megatron_gpt_model import MegatronGPTModel
import nemo; assert nemo.__version__ == "2.4.1", nemo.__version__
'
} >"$log" 2>&1 || { tail -n 40 "$log" >&2; echo "setup-nemo-env: failed (see $log)" >&2; exit 1; }
echo "$want" >"$stamp"
link
echo "setup-nemo-env: ready in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))" >&2
