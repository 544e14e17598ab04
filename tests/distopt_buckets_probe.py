"""Run under torchrun (2 ranks, CPU): the distributed optimizer against the replicated one on DDP with several
buckets, overlapped gradient reduction and gradient accumulation (what GPUs run; `snakellm train` on the CPU
reduces in one bucket). Prints one JSON line: per precision, per optimizer, the (loss, grad norm) of each step."""

from __future__ import annotations

import contextlib
import json

import torch

from snakellm import models
from snakellm.launch import runtime
from snakellm.launch.distributed import detect


def main() -> None:
    torch.set_num_threads(1)
    d = detect()
    runtime.init_process_group(torch, d, runtime.pick_device(torch, "cpu"))
    runtime.init_model_parallel(1, 1)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from snakellm.models.build import build_model
    from snakellm.train.optim import DistributedAdamW, MixedPrecisionAdamW

    arch = models.resolve("tiny-llama", {"seq_length": 32})
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    buckets = 0
    for precision in ("fp32", "bf16"):
        variants = (
            ("replicated", MixedPrecisionAdamW, False),
            ("distributed", DistributedAdamW, False),
            ("distributed-overlap", DistributedAdamW, True),  # the all-gather in the next forward's pre-hooks
        )
        for name, cls, overlap in variants:
            torch.manual_seed(0)
            module, cfg = build_model(arch, 256, bf16=precision == "bf16")
            ddp_cfg = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=True,
                use_distributed_optimizer=cls is DistributedAdamW,
                overlap_param_gather=overlap,
                bucket_size=3000,  # about 10 buckets for this model
            )
            model = DistributedDataParallel(cfg, ddp_cfg, module)
            model.broadcast_params()
            buckets = len(model.bucket_groups)
            opt = cls(model, lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=0.5)
            gen = torch.Generator().manual_seed(1 + d.rank)
            steps = []
            for _ in range(8):
                model.zero_grad_buffer()
                for micro in range(2):
                    tok = torch.randint(0, 256, (2, 32), generator=gen)
                    pos = torch.arange(32).expand(2, 32)
                    with model.no_sync() if micro == 0 else contextlib.nullcontext():
                        loss = model(tok, pos, None, labels=tok).float().mean()
                        (loss / 2).backward()
                model.finish_grad_sync()
                norm = opt.step(3e-3)
                steps.append((loss.item(), norm.item()))
            out.setdefault(precision, {})[name] = steps
    if d.rank == 0:
        print(json.dumps({"buckets": buckets, "steps": out}))
    runtime.shutdown()


if __name__ == "__main__":
    main()
