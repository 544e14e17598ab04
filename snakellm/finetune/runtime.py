"""The torch side shared by finetune, evaluate and the adapter tools.

* :func:`start`: process group (gloo on CPU with an in-memory store for one
  process, NCCL on GPU), megatron-core model-parallel state, the CPU shims.
* :func:`load_base`: a pretrained run's model (run dir, its ``checkpoints/`` or one
  ``iter_NNNNNNN/``): architecture and padded vocabulary from ``run_config.json``,
  weights (only the ``model`` part of the checkpoint) through
  ``megatron.core.dist_checkpointing``, resharded to this tensor-parallel size.
* :class:`FTModel`: the base GPTModel plus the method's trainable part (LoRA
  adapters or the p-tuning prompt encoder), so that megatron-core's DDP and the
  optimizer see exactly the parameters that train.
* :func:`load_tokenizer`: the tokenizer named by a blend.json's ``tokenizer`` block.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snakellm.train import checkpoint as ckpt


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

    d = distmod.detect()
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise BaseModelError("--device cuda: no CUDA device is available")
    if not cuda:
        if tp != 1:
            raise BaseModelError(f"tensor parallel size {tp} needs GPUs; on the CPU use tp 1")
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        if threads:
            torch.set_num_threads(threads)
    if d.world_size % tp:
        raise BaseModelError(f"world size {d.world_size} is not divisible by tensor parallel size {tp}")
    warnings.filterwarnings("ignore", message=r".*(Apex|apex|Transformer Engine|TransformerEngine).*")
    from megatron.core import parallel_state, tensor_parallel

    distmod.export(d)
    if cuda:
        dev = torch.device("cuda", d.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if not torch.distributed.is_initialized():
        store = torch.distributed.HashStore() if d.world_size == 1 else None
        torch.distributed.init_process_group(backend="nccl" if cuda else "gloo", rank=d.rank,
                                             world_size=d.world_size, store=store,
                                             **({"device_id": dev} if cuda else {}))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, 1)
    torch.manual_seed(seed)
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return Runtime(torch, dev, cuda, d.rank, d.world_size, tp)


def stop() -> None:
    import contextlib

    import torch
    from megatron.core import parallel_state

    with contextlib.suppress(Exception):
        parallel_state.destroy_model_parallel()
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()


def resolve_checkpoint(path: str | os.PathLike, iteration: int | None = None) -> tuple[Path, int]:
    """(checkpoints dir, iteration) from a run dir, a checkpoints dir or an iter_NNNNNNN dir."""
    p = Path(path)
    if p.name.startswith("iter_") and p.is_dir():
        return p.parent, int(p.name[5:])
    if (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    if not p.is_dir():
        raise BaseModelError(f"{path}: no such run or checkpoint directory")
    it = iteration if iteration is not None else ckpt.latest_iteration(p)
    if it is None:
        raise BaseModelError(f"{p}: no checkpoint ({ckpt.TRACKER} missing)")
    if not ckpt.is_complete(p / ckpt.iter_name(it)):
        raise BaseModelError(f"{p / ckpt.iter_name(it)}: missing or incomplete checkpoint")
    return p, it


def base_config(ckpt_dir: Path) -> tuple[dict, int]:
    """(architecture dict, padded vocabulary) stored with a run's checkpoints."""
    rc = ckpt.read_run_config(ckpt_dir)
    cfg = (rc or {}).get("config") or {}
    if "model" not in cfg or "padded_vocab" not in cfg:
        raise BaseModelError(f"{ckpt_dir / ckpt.RUN_CONFIG}: missing or without model/padded_vocab")
    return dict(cfg["model"]), int(cfg["padded_vocab"])


def load_base(rt: Runtime, path: str | os.PathLike, *, bf16: bool = False, iteration: int | None = None,
              seq_length: int | None = None):
    """(GPTModel with the checkpoint's weights, arch dict, padded vocab, checkpoint path)."""
    from megatron.core import dist_checkpointing

    from snakellm.models import architecture as models

    ckpt_dir, it = resolve_checkpoint(path, iteration)
    arch, vocab = base_config(ckpt_dir)
    if seq_length is not None and seq_length != arch["seq_length"]:
        if arch["position_embedding"] == "learned":
            if seq_length > arch["seq_length"]:
                raise BaseModelError(
                    f"sequence length {seq_length} is beyond the model's {arch['seq_length']} learned positions")
        else:  # rotary positions: any length (the position table is not a weight)
            arch["seq_length"] = seq_length
    if vocab % rt.tp:
        raise BaseModelError(f"padded vocabulary {vocab} is not divisible by tensor parallel size {rt.tp}")
    models.check_parallel(arch, rt.tp, 1)
    model, tcfg = models.build_model(arch, vocab, tp=rt.tp, device=str(rt.device), bf16=bf16,
                                     fused_loss="eager" if rt.tp == 1 else "megatron")
    sd = model.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": sd}, str(ckpt_dir / ckpt.iter_name(it)))
    model.load_state_dict(loaded["model"], strict=True)
    return model, tcfg, arch, vocab, ckpt_dir / ckpt.iter_name(it)


def load_tokenizer(blend_or_info: str | os.PathLike | dict):
    """The tokenizer of a blend.json (its ``tokenizer`` block: kind + files), or of such a block."""
    from snakellm.tokenize import encoders

    if isinstance(blend_or_info, dict):
        info = blend_or_info
    else:
        try:
            info = json.loads(Path(blend_or_info).read_text())["tokenizer"]
        except (OSError, ValueError, KeyError) as e:
            raise BaseModelError(f"{blend_or_info}: no tokenizer block: {e}") from None
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
