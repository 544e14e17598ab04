"""The torch side shared by evaluate, the adapter tools and the fine-tuning tests.

* :func:`start`: ranks from the launcher (snakellm.launch.distributed), process group
  (gloo on CPU, NCCL on GPU), megatron-core model-parallel state and the CPU shims
  (snakellm.launch.runtime). Fine-tuning itself starts its job through the training
  assembly (snakellm.train.assembly); models come back through :func:`snakellm.models.load`.
* :func:`make_ft_model`: the base GPTModel plus the method's trainable part (LoRA
  adapters or the p-tuning prompt encoder) as one module, so megatron-core's DDP
  and the optimizer see exactly the parameters that train.
* :func:`load_tokenizer`: the tokenizer of a run's tokenizer block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from snakellm.errors import UsageError


class BaseModelError(UsageError, ValueError):
    pass


@dataclass
class Runtime:
    torch: Any
    device: Any
    cuda: bool
    rank: int
    world_size: int
    tp: int


def start(device: str = "auto", tp: int = 1, threads: int | None = None, seed: int = 1234) -> Runtime:
    import torch

    from snakellm.launch import distributed as distmod
    from snakellm.launch import runtime as lr
    from snakellm.train.rng import seed_all

    d = distmod.detect()
    try:
        cuda = lr.prepare(torch, device, tp, threads)
    except lr.LaunchError as e:
        raise BaseModelError(str(e)) from None
    if d.world_size % tp:
        raise BaseModelError(f"world size {d.world_size} is not divisible by tensor parallel size {tp}")
    from megatron.core import parallel_state, tensor_parallel

    distmod.export(d)
    dev = lr.pick_device(torch, "cuda" if cuda else "cpu", d.local_rank)
    if not torch.distributed.is_initialized():
        lr.init_process_group(torch, d, dev)
    seed_all(seed)
    if not parallel_state.model_parallel_is_initialized():
        lr.init_model_parallel(tp, 1, seed=None, cuda=cuda)
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return Runtime(torch, dev, cuda, d.rank, d.world_size, tp)


def stop() -> None:
    from snakellm.launch.runtime import shutdown

    shutdown()


def load_tokenizer(block: dict[str, Any]) -> Any:
    """The tokenizer of a run's tokenizer block (``kind`` + ``files``), as :func:`snakellm.models.load` returns it."""
    from snakellm.tokenize import encoders

    files = block.get("files") or {}
    return encoders.load(block["kind"], name=block.get("name", ""), eod=block.get("eod_token"), **files)


def make_ft_model(torch, gpt):
    from torch import nn

    class FTModel(nn.Module):
        """The base model and the method's trainable extras as one module (DDP and the optimizer see both)."""

        def __init__(self, gpt, extra=None):
            super().__init__()
            self.gpt = gpt
            self.extra = extra

        def forward(self, tokens, position_ids, attention_mask=None, labels=None):
            return self.gpt(tokens, position_ids, attention_mask, labels=labels)

    return FTModel(gpt)
