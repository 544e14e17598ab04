#!/bin/bash
# llama-1b on 2 GPUs: data parallel with the replicated optimizer vs the distributed one, 20 steps, fp32 and bf16:
# per-step loss and gradient norm side by side (scripts/bench_parallel_gpu.py's settings otherwise).
# Run from the repository root with data/tokens/gpt2 built; README's GPU section quotes its output
# (docs/bench/distopt-check-2xh200.txt).
set -u
W=/tmp/chk; mkdir -p $W
for prec in fp32 bf16; do
  for opt in replicated distributed; do
    extra=""; [ $opt = distributed ] && extra="--distributed-optimizer"
    torchrun --standalone --nnodes=1 --nproc-per-node=2 --no-python snakellm train --blend data/tokens/gpt2/blend.json \
      --run-dir $W/$prec-$opt --preset llama-1b --seq-length 2048 --steps 20 --micro-batch-size 4 --global-batch-size 8 \
      --lr 3e-4 --min-lr 3e-5 --warmup-steps 5 --eval-iters 0 --log-interval 1 --no-checkpoints --no-tensorboard \
      --no-progress --loss megatron --split 100,0,0 --seed 1234 --precision $prec $extra > $W/$prec-$opt.log 2>&1 \
      || { echo "FAILED $prec $opt"; tail -30 $W/$prec-$opt.log; }
  done
  python3 - $W/$prec-replicated/metrics.jsonl $W/$prec-distributed/metrics.jsonl $prec <<'PY'
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
print(sys.argv[3], "step | loss replicated, distributed | grad norm replicated, distributed | rel. differences")
for x, y in zip(a, b):
    print(f"{x['step']:3d} | {x['loss']:.6f} {y['loss']:.6f} | {x['grad_norm']:.6f} {y['grad_norm']:.6f} | "
          f"{abs(x['loss']-y['loss'])/x['loss']:.1e} {abs(x['grad_norm']-y['grad_norm'])/x['grad_norm']:.1e}")
PY
done
