"""The torch side shared by finetune, evaluate and the adapter tools, on the lead's launch/models API.

* :func:`start`: ranks from the launcher (snakellm.launch.distributed), process group
  (gloo on CPU, NCCL on GPU), megatron-core model-parallel state and the CPU shims
  (snakellm.launch.runtime).
* :func:`load_base`: a pretrained (or imported, or fully fine-tuned) run's model,
  resolved by ``snakellm.models.load.describe_run`` (run dir, its ``checkpoints/``
  or one ``iter_NNNNNNN/``) and built at this job's tensor-parallel size; only the
  ``model`` part of the checkpoint is read (dist_checkpointing reshards it).
* :func:`make_ft_model`: the base GPTModel plus the method's trainable part (LoRA
  adapters or the p-tuning prompt encoder) as one module, so megatron-core's DDP
  and the optimizer see exactly the parameters that train.
* :func:`load_tokenizer`: the tokenizer recorded with the run (or a blend.json's).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snakellm.io import checkpoint as ckpt


class BaseModelError(ValueError):
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


def load_base(
    rt: Runtime,
    path: str | os.PathLike,
    *,
    bf16: bool = False,
    iteration: int | None = None,
    seq_length: int | None = None,
):
    """(GPTModel with the checkpoint's weights, TransformerConfig, arch dict, padded vocab, iter dir, tokenizer info)."""
    from snakellm.models import architecture as models
    from snakellm.models.build import build_model
    from snakellm.models.loading import LoadError, describe_run

    try:
        info = describe_run(path, iteration)
    except (LoadError, ckpt.CheckpointError) as e:
        raise BaseModelError(str(e)) from None
    arch, vocab = dict(info["arch"]), int(info["padded_vocab_size"])
    if seq_length is not None and seq_length != arch["seq_length"]:
        if arch["position_embedding"] == "learned":
            if seq_length > arch["seq_length"]:
                raise BaseModelError(
                    f"sequence length {seq_length} is beyond the model's {arch['seq_length']} learned positions"
                )
        else:  # rotary positions: any length (the position table is not a weight)
            arch["seq_length"] = seq_length
    if vocab % rt.tp:
        raise BaseModelError(f"padded vocabulary {vocab} is not divisible by tensor parallel size {rt.tp}")
    try:
        models.check_parallel(arch, rt.tp, 1)
    except models.ModelConfigError as e:
        raise BaseModelError(str(e)) from None
    gpt, tcfg = build_model(
        arch,
        vocab,
        tp=rt.tp,
        device=str(rt.device),
        bf16=bf16,
        fused_loss=("auto" if rt.cuda else "eager") if rt.tp == 1 else "megatron",
    )
    loaded = ckpt.load(info["checkpoint_dir"], info["iteration"], {"model": gpt.sharded_state_dict()})
    gpt.load_state_dict(loaded["model"], strict=True)
    return gpt, tcfg, arch, vocab, info["checkpoint_dir"] / ckpt.iter_name(info["iteration"]), info["tokenizer"]


def load_tokenizer(info_or_blend: str | os.PathLike | dict | None, fallback: dict | None = None):
    """The tokenizer of a run's recorded block (``kind`` + ``files``), or of a blend.json's ``tokenizer``."""
    from snakellm.tokenize import encoders

    if isinstance(info_or_blend, dict):
        info = info_or_blend
    elif info_or_blend:
        try:
            info = json.loads(Path(info_or_blend).read_text())["tokenizer"]
        except (OSError, ValueError, KeyError) as e:
            raise BaseModelError(f"{info_or_blend}: no tokenizer block: {e}") from None
    elif fallback:
        info = fallback
    else:
        raise BaseModelError("no tokenizer: the run records none and no --blend was given")
    files = info.get("files") or {}
    return encoders.load(info["kind"], name=info.get("name", ""), eod=info.get("eod_token"), **files)


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
