#!/bin/bash
# The seed's chain at 8B on GPUs (issue 31): config/examples/llama3-8b-lora-squad-gpu.yaml, one layout
# per call (each about 8 minutes on 4 H100s): random 8B-shaped weights -> import-hf (streamed) ->
# [the base's .nemo] -> LoRA (packed, seq 4096) -> evaluation of the SQuAD test split through the engine
# -> PEFT adapter and merged Hugging Face model. Printed: each job's wall time and the GPUs' peak
# memory while it ran (nvidia-smi every second), the fine-tune's tokens/s and peak, the evaluations'
# examples/s, exact match and peak, the exports' sizes.
#
#   LAYOUT=tp4 bash scripts/gpu_8b_chain.sh      # TP 4 on 4 GPUs (the seed's layout) and the base's .nemo
#   LAYOUT=tp1 bash scripts/gpu_8b_chain.sh      # TP 1 on one GPU
#   SMOKE=1 bash scripts/gpu_8b_chain.sh         # CPU: the same chain on tiny-llama's shape (minutes)
#
# Without Snakemake installed (a bare GPU machine), the jobs of the example's own dry run
# (scripts/chain8b.jobs.json, recorded by scripts/dry_run_jobs.py; tests/test_examples.py keeps it equal
# to a fresh dry run) are run in dependency order instead: the same commands, the same files.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
LAYOUT=${LAYOUT:-tp4}
SMOKE=${SMOKE:-0}
OUT=${OUT:-/tmp/chain8b-out}
W=${W:-/tmp/chain8b-$LAYOUT}
LIMIT=${LIMIT:-540}
mkdir -p "$OUT" "$W/resources" "$W/bin"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
if ! command -v snakellm >/dev/null; then  # the rules call `snakellm STEP`: the package's CLI from this checkout
  printf '#!/bin/bash\nexec python -m snakellm.cli "$@"\n' >"$W/bin/snakellm"
  chmod +x "$W/bin/snakellm"
  export PATH=$W/bin:$PATH
fi
cp -r resources/squad resources/tokenizers "$W/resources/"
python - "$REPO/config/examples/llama3-8b-lora-squad-gpu.yaml" "$W/config.yaml" "$LAYOUT" "$SMOKE" <<'PY'
import sys, yaml
src, dst, layout, smoke = sys.argv[1:]
cfg = yaml.safe_load(open(src))
cfg["finetune"] = {k: v for k, v in cfg["finetune"].items() if k.endswith(layout)}
if layout != "tp4":
    cfg["export_nemo"] = {"enabled": False}  # the base's .nemo is made once, in the tp4 call
if smoke == "1":  # tiny-llama's shape on the CPU, a few steps and test examples, fp32
    cfg["import_hf"]["llama3-8b"]["random"]["preset"] = "tiny-llama"
    cfg["sft_data"]["squad"].update(limit=40, split="24,8,8")
    for ft in cfg["finetune"].values():
        ft["examples"]["max_seq_length"] = 128
        ft["examples"]["packing"] = True
        ft["train"].update(steps=4, warmup_steps=0, eval_interval=2, global_batch_size=2, micro_batch_size=1)
        ft["train"]["precision"] = "fp32"
        ft["parallel"] = {"tp": 1}
        ft["resources"] = {}
        ft["evaluate"]["tokens_to_generate"] = 4
yaml.safe_dump(cfg, open(dst, "w"), sort_keys=False)
PY
SMI=""
if [ "$SMOKE" != 1 ]; then
  nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader,nounits -l 1 >"$OUT/chain-$LAYOUT-gpu.csv" 2>/dev/null &
  SMI=$!
fi
T0=$(date +%s)
echo "=== chain $LAYOUT: snakemake finetunes in $W (limit $LIMIT s)"
if python -c "import snakemake" 2>/dev/null; then
  ( cd "$W" && timeout -k 20 "$LIMIT" snakemake -s "$REPO/Snakefile" -d "$W" --configfile config.yaml \
      --replace-workflow-config -c 32 --resources gpu=4 --nocolor --printshellcmds finetunes ) >"$OUT/chain-$LAYOUT.log" 2>&1
  RC=$?
else
  echo "snakemake is not installed: running the example's recorded dry-run jobs (scripts/chain8b.jobs.json) in order"
  OTHER=$([ "$LAYOUT" = tp4 ] && echo tp1 || echo tp4)
  python - "$REPO/scripts/chain8b.jobs.json" "$W/jobs.json" "$OTHER" "$LAYOUT" <<'PY'
import json, sys
src, dst, other, layout = sys.argv[1:]
jobs = [j for j in json.load(open(src)) if f"lora-{other}" not in json.dumps(j)]
if layout != "tp4":
    jobs = [j for j in jobs if j["rule"] != "export_nemo"]
json.dump(jobs, open(dst, "w"))
PY
  timeout -k 20 "$LIMIT" python scripts/dry_run_jobs.py run "$W/jobs.json" --workdir "$W" \
    --background export_nemo,merge_lora_hf,export_peft >"$OUT/chain-$LAYOUT.log" 2>&1
  RC=$?
fi
[ -n "$SMI" ] && kill "$SMI" 2>/dev/null
echo "=== chain $LAYOUT: snakemake exit $RC$([ $RC -eq 124 ] && echo ' (time limit)'), wall $(($(date +%s) - T0)) s"
[ $RC -ne 0 ] && { grep -E "Error|error|Exception" "$OUT/chain-$LAYOUT.log" | tail -10; for f in "$W"/logs/*/*.log "$W"/logs/*/*/*.log; do
  [ -s "$f" ] && grep -qE "Error|Traceback" "$f" && { echo "--- $f"; tail -15 "$f"; }; done; }
python - "$OUT/chain-$LAYOUT.log" "$OUT/chain-$LAYOUT-gpu.csv" "$W" <<'PY'
import datetime as dt, json, re, sys
from pathlib import Path
log, smi, work = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
# snakemake's log: "[Thu Nov 26 23:07:33 2026]" then "rule NAME:" ... "jobid: N", and "Finished jobid: N"
stamp, jobs, cur = None, {}, None
for line in log.read_text(errors="replace").splitlines():
    m = re.match(r"^\[(\w{3} \w{3} +\d+ [\d:]+ \d{4})\]$", line.strip())
    if m:
        stamp = dt.datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y")
        continue
    m = re.match(r"^(?:local)?rule (\w+):$", line.strip())
    if m:
        cur = [m.group(1), stamp]
        continue
    m = re.match(r"^jobid: (\d+)$", line.strip())
    if m and cur:
        jobs[int(m.group(1))] = {"rule": cur[0], "start": cur[1], "end": None}
        cur = None
        continue
    m = re.search(r"Finished job(?:id)?:? (\d+)", line)
    if m and int(m.group(1)) in jobs:
        jobs[int(m.group(1))]["end"] = stamp
mem = []  # (time, gpu, MiB)
if smi.exists():
    for line in smi.read_text().splitlines():
        try:
            t, g, m = [x.strip() for x in line.split(",")]
            mem.append((dt.datetime.strptime(t.split(".")[0], "%Y/%m/%d %H:%M:%S"), int(g), int(m)))
        except ValueError:
            pass
print("job                 wall s   peak GPU memory while it ran (MiB, per GPU)")
for j in sorted(jobs.values(), key=lambda j: j["start"] or dt.datetime.min):
    if j["rule"] in ("finetunes",) or j["start"] is None:
        continue
    end = j["end"]
    wall = f"{(end - j['start']).total_seconds():7.0f}" if end else "   (unfinished)"
    peaks = {}
    for t, g, m in mem:
        if j["start"] <= t <= (end or t):
            peaks[g] = max(peaks.get(g, 0), m)
    print(f"{j['rule']:<18} {wall}   {' '.join(f'{g}:{m}' for g, m in sorted(peaks.items())) or '-'}")
for p in sorted(work.glob("runs/*/finetune/*/finetune_summary.json")):
    s = json.loads(p.read_text())
    print(f"{p.parent.name}: {s['steps_run']} steps, loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}, "
          f"median {s['median_tokens_per_s']:,.0f} tokens/s, peak {s.get('peak_gpu_memory_gib')} GiB (rank 0), "
          f"{s['trainable_parameters']:,} of {s['total_parameters']:,} parameters trained, {s['sequences']} packed "
          f"sequences from {s['train_examples']} examples")
for p in sorted(work.glob("runs/*/eval/**/metrics.json")):
    m = json.loads(p.read_text())
    g = m.get("generation", {})
    print(f"evaluate {p.parent.relative_to(work / 'runs')}: {m['examples']} examples, exact match "
          f"{m['test_exact_string_match']:.3f}, {g.get('examples_per_s')} examples/s through the engine "
          f"({g.get('seconds')} s), peak {g.get('peak_gpu_memory_gib')} GiB")
for pat in ("models/random/*", "runs/*/*.nemo", "runs/*/finetune/*/hf_peft", "runs/*/finetune/*/hf_merged"):
    for p in sorted(work.glob(pat)):
        size = sum(f.stat().st_size for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
        print(f"{p.relative_to(work)}: {size / 2**30:.2f} GiB")
PY
exit $RC
