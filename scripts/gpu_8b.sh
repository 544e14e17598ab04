#!/bin/bash
# Issue 31's GPU figures at 8B, unattended, about 7-8 minutes on 4 H100s (80 GB) or H200s:
#   A  LoRA (all linears, rank 32) on Llama 3.1 8B's shape, sequence 4096, one GPU
#      (bar 12,500 tokens/s; NeMo AutoModel's anchor 12,473 tokens/s/GPU)        GPU 0
#   B  8B generation: engine batch 1 vs the bandwidth bound (bar >= 60%), batch 32 vs
#      transformers' generate (bar >= 5x; also with the engine's compile setting), evaluation-shaped
#      prompts (examples/s)                                                        GPU 1, beside A
#   E  the same LoRA on an FP8 base (--precision fp8: torchao float8 matmuls, issue 30)  GPU 2, beside A
#   C  the same LoRA tensor parallel over 4 GPUs (the seed's layout; bar: >= 70% scaling per GPU), micro batch
#      C_MBS (default 4: one micro-batch of 4,096 tokens a launch left the step bound by kernel launches and
#      waiting collectives, 42% scaling on 4 H200s; 4 gave 70%)
#   D  full SFT of the same shape, FSDP over 4 GPUs (snakellm finetune --fsdp), sequence 4096, micro
#      batch 1, no recomputation (snakellm plan's estimate: 48.2 GiB a GPU; 80 GB cards) (bar: 50% MFU;
#      DGX Cloud's Llama 3 8B SFT, 8 H100s, Transformer Engine: 12,412 tokens/s/GPU)
# Every stage has its own time limit; a failed stage is reported (its log's tail) and the next one
# runs. Printed per stage: exit status, wall time, its figures; at the end the peak memory of
# each GPU over the run (nvidia-smi every second) and a one-line summary per figure.
#
#   bash scripts/gpu_8b.sh                       # from the repository root; logs and JSON to $OUT
#   PRESET=llama2-7b bash scripts/gpu_8b.sh      # Llama-2 7B's shape instead
#   SMOKE=1 bash scripts/gpu_8b.sh               # CPU, tiny model: A, B and D in a minute or two
#   D_MBS=2 STAGES=D bash scripts/gpu_8b.sh      # D alone (~2.5 min) at micro batch 2 (plan: 66.4 GiB a GPU)
#   PROFILE=5:5 STAGES=AC bash scripts/gpu_8b.sh  # with each fine-tune's kernel table of step 5 ($OUT/X/*.profile.txt)
#   FT_FLAGS="--compile" STAGES=D bash scripts/gpu_8b.sh   # extra bench_finetune_gpu.py flags for every fine-tune
#   OUT=/tmp/o bash scripts/gpu_8b.sh && cp /tmp/o/bundle.tgz "$DEVICE_OUT"   # all logs as one file ($OUT/bundle.tgz)
#   STAGES=CD ONE=13414 STEPS=6 bash scripts/gpu_8b.sh   # only the 4-GPU stages (<= 4.5 min), the one-GPU LoRA
#                                                # figure from an earlier run (same card) for the scaling
#   TP=2 NPROC=2 STAGES=ABC bash scripts/gpu_8b.sh   # on 2 GPUs: C tensor parallel over 2 (D: FSDP over 2)
#   GEN_BATCHES=1,16,32 C_LIMIT=200 ...          # generation's batch sizes; stage C's time limit (s)
#   TP=2 NPROC=2 STAGES=ACE E_GPU=1 ...           # E on GPU 1 (without B) on a 2-GPU machine
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu8b-out}
W=${W:-/tmp/gpu8b-work}
PRESET=${PRESET:-llama3-8b}
SMOKE=${SMOKE:-0}
STAGES=${STAGES:-ABCDE}
STEPS=${STEPS:-8}
D_MBS=${D_MBS:-1}
C_MBS=${C_MBS:-4}
ONE=${ONE:-}
mkdir -p "$OUT" "$W"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
T0=$(date +%s)

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, print its figures
  local name=$1 limit=$2 s rc
  shift 2
  s=$(date +%s)
  echo "=== $name: start at +$((s - T0)) s: $*"
  timeout -k 20 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  {
    echo "=== $name: exit $rc$([ $rc -eq 124 ] && echo ' (time limit)'), wall $(($(date +%s) - s)) s"
    grep -E "tokens/s|bar:|bound|examples/s|peak|FAILED|smoke:|base checkpoint|model:" "$OUT/$name.log" | cut -c1-600 | tail -30
    [ $rc -ne 0 ] && { echo "--- $name: last lines"; tail -25 "$OUT/$name.log" | cut -c1-400; }
  } | tee "$OUT/$name.summary"
  return $rc
}

if [ "$SMOKE" = 1 ]; then
  FT=(python scripts/bench_finetune_gpu.py --smoke --workdir "$W")
  GEN=(python scripts/bench_generate_gpu.py --smoke)
  TP=1
  NPROC=2
else
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -l 1 >"$OUT/gpu-memory.csv" 2>/dev/null &
  SMI=$!
  python -c "import torch, megatron.core, transformers; print('torch', torch.__version__, 'megatron-core', \
megatron.core.__version__, 'transformers', transformers.__version__, 'GPUs', torch.cuda.device_count())"
  FT=(python scripts/bench_finetune_gpu.py --preset "$PRESET" --seq-length 4096 --micro-batch-size 1
    --global-batch-size 8 --steps "$STEPS" --warmup-steps $((STEPS > 6 ? 3 : 2)) --workdir "$W" --timeout 240
    ${PROFILE:+--profile-steps "$PROFILE"} ${FT_FLAGS:-})
  GEN=(python scripts/bench_generate_gpu.py --preset "$PRESET" --batch-sizes "${GEN_BATCHES:-1,32}" --repeats 2
    --clients 0 --eval-prompts 256 --no-eager --compile)
  TP=${TP:-4}
  NPROC=${NPROC:-4}
fi

# A and B side by side (GPU 0: the base checkpoint, then LoRA on one GPU; GPU 1: generation)
GEN_PID=""
if [[ $STAGES == *B* ]]; then
  CUDA_VISIBLE_DEVICES=1 stage B-generate 340 "${GEN[@]}" --json "$OUT/generate.json" &
  GEN_PID=$!
fi
# E (GPU 2, beside A and B; its own base checkpoint): the same LoRA on an FP8 base (issue 30's 8B LoRA figure)
E_PID=""
if [[ $STAGES == *E* && $SMOKE != 1 ]]; then
  CUDA_VISIBLE_DEVICES=${E_GPU:-2} stage E-lora-fp8-1gpu 280 "${FT[@]}" --workdir "$W-e" --methods lora-all --precision fp8 \
    --out "$OUT/E" &
  E_PID=$!
fi
if [[ $STAGES == *A* ]]; then
  CUDA_VISIBLE_DEVICES=0 stage A-lora-1gpu 280 "${FT[@]}" --methods lora-all --out "$OUT/A"
  ONE=$(python -c "import json; r=json.load(open('$OUT/A/bench_finetune.json'))[0]; print(r.get('tokens_per_s', 0))" \
    2>/dev/null || echo 0)
fi
[ -n "$GEN_PID" ] && wait $GEN_PID
[ -n "$E_PID" ] && wait $E_PID
if [ "$SMOKE" != 1 ]; then
  # A, B and E ran 183-211 s on 4 H200s (B's limit 340 s with its compiled engine), C and D about 100-120 s each:
  # about 8.5 minutes of a 10-minute call; worst case past it (C makes the base checkpoint, ~55-77 s, when A did
  # not run)
  C_LIMIT=${C_LIMIT:-$([[ $STAGES == *A* ]] && echo 150 || echo 145)}
  [[ $STAGES == *C* ]] && stage C-lora-tp$TP "$C_LIMIT" "${FT[@]}" --timeout $((C_LIMIT - 15)) \
    --methods lora-all --tp $TP --tp-only --one-gpu-tokens-per-s "${ONE:-0}" --micro-batch-size "$C_MBS" --out "$OUT/C"
fi
# D: full SFT with FSDP over the 4 GPUs (smoke: 2 CPU ranks, fp32); the base checkpoint is A's or C's
# (STAGES=D alone makes it first, ~55 s, inside a longer limit)
[[ $STAGES == *D* ]] && stage D-full-fsdp$NPROC $([[ $STAGES == *[AC]* ]] && echo 150 || echo 210) "${FT[@]}" \
  --timeout $([[ $STAGES == *[AC]* ]] && echo 135 || echo 195) --methods full --fsdp --nproc $NPROC --tp-only \
  $([ "$SMOKE" = 1 ] || echo --micro-batch-size "$D_MBS") --out "$OUT/D"
if [ "$SMOKE" != 1 ]; then
  kill "$SMI" 2>/dev/null
  echo "=== peak GPU memory over the run (MiB, nvidia-smi every second):"
  awk -F', ' '{ if ($2 > m[$1]) m[$1] = $2 } END { for (g in m) print "GPU " g ": " m[g] " MiB" }' "$OUT/gpu-memory.csv" | sort
fi
echo "=== summary ($PRESET, total $(($(date +%s) - T0)) s)"
python - "$OUT" "$PRESET" "$TP" <<'PY'
import json, sys
from pathlib import Path
out, preset, tp = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def rows(stage):
    p = out / stage / "bench_finetune.json"
    return json.loads(p.read_text()) if p.exists() else []
one = next((r["tokens_per_s_per_gpu"] for r in rows("A") if "error" not in r), None)
for stage, what in (("A", "LoRA, one GPU"), ("E", "LoRA on an FP8 base, one GPU"), ("C", f"LoRA, TP {tp}"),
                    ("D", "full SFT, FSDP")):
    for r in rows(stage):
        if "error" in r:
            print(f"{what}: FAILED ({r['error']})")
            continue
        extra = ""
        if stage == "A":
            extra = f"; bar 12,500: {'PASS' if r['tokens_per_s_per_gpu'] >= 12500 else 'FAIL'} (AutoModel 12,473)"
        if stage == "E" and one:
            extra = f"; {r['tokens_per_s_per_gpu'] / one:.2f}x the bf16 base (A)"
        if stage == "C" and "scaling_efficiency" in r:
            e = r["scaling_efficiency"]
            extra = f"; scaling {e:.0%} per GPU, bar 70%: {'PASS' if e >= 0.7 else 'FAIL'}"
        if stage == "D":
            m = r["mfu_989"]
            extra = (f"; MFU {m:.1%} (6N + 12Lhs, 989.4 TFLOP/s), bar 50%: {'PASS' if m >= 0.5 else 'FAIL'}; "
                     f"DGX Cloud SFT 12,412 tokens/s/GPU: {r['tokens_per_s_per_gpu'] / 12412:.2f}x")
        print(f"{what}: {r['tokens_per_s_per_gpu']:,} tokens/s/GPU, peak {r.get('peak_gpu_memory_gib')} GiB, "
              f"wall {r['wall_s']} s{extra}")
g = out / "generate.json"
if g.exists():
    j = json.loads(g.read_text())
    bound = j["bound"]["tokens_per_s"]
    for b, r in j.get("batches", {}).items():
        v = r["engine_tokens_per_s"]
        if b == "1":
            print(f"generation batch 1: {v:,.0f} tokens/s = {v / bound:.0%} of the bound {bound:,.0f}, "
                  f"bar 60%: {'PASS' if v >= 0.6 * bound else 'FAIL'}")
        else:
            s = r["speedup_vs_transformers"]
            print(f"generation batch {b}: {v:,.0f} tokens/s, {s:.2f}x transformers "
                  f"({r['transformers_tokens_per_s']:,.0f}), bar 5x: {'PASS' if s >= 5 else 'FAIL'}")
        if "engine_compiled_tokens_per_s" in r:
            c = r["engine_compiled_tokens_per_s"]
            print(f"generation batch {b}, the engine's compile setting: {c:,.0f} tokens/s, "
                  f"{c / r['transformers_tokens_per_s']:.2f}x transformers")
    if "eval" in j:
        print(f"evaluation-shaped prompts through the engine: {j['eval']['engine_examples_per_s']:.1f} examples/s")
else:
    print("generation: no results (see B-generate.log)")
PY
# one file with everything (a device call returns at most 8 files): $OUT's logs, JSON and kernel tables, and
# each fine-tune's own logs from the work directory
if [ "$SMOKE" != 1 ]; then
  tar czf /tmp/gpu8b-bundle.tgz -C "$OUT" . -C "$(cd "$W" && pwd)" $(cd "$W" && find runs -name '*.log' -o -name 'profile.txt' 2>/dev/null) \
    2>/dev/null && mv /tmp/gpu8b-bundle.tgz "$OUT/bundle.tgz" && echo "=== everything in one file: $OUT/bundle.tgz"
fi
