"""Read and write model-only checkpoints for export, import and generation.

Stand-in for ``snakellm.models.load`` (issue 8) until it lands on main: the same
signatures, so callers switch by changing one import. A run's checkpoint dir is
Megatron-LM's ``iter_{N:07d}/`` + ``latest_checkpointed_iteration.txt`` with a
``run_config.json`` holding the architecture (``config.model``), the padded
vocabulary and the blend's tokenizer block.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snakellm.io.atomic import write_json
from snakellm.train import checkpoint as ckpt


class LoadError(ValueError):
    """A checkpoint that cannot be loaded, phrased with the path at fault."""


@dataclass
class LoadedModel:
    model: Any
    arch: dict[str, Any]
    padded_vocab_size: int
    tokenizer: dict[str, Any]
    iteration: int
    checkpoint: Path
    device: str = "cpu"
    extra: dict = field(default_factory=dict)


def resolve_checkpoint(path: str | os.PathLike, iteration: int | None = None) -> tuple[Path, int]:
    """(checkpoints dir, iteration) for a run dir, its checkpoints/ dir or one iter_NNNNNNN/ dir; plain Python."""
    p = Path(path)
    if not p.exists():
        raise LoadError(f"{p}: no such checkpoint or run directory")
    if p.name.startswith("iter_") and (p / "metadata.json").exists():
        return p.parent, int(p.name[5:])
    d = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    try:
        it = iteration if iteration is not None else ckpt.latest_iteration(d)
    except ckpt.CheckpointError as e:
        raise LoadError(str(e)) from None
    if it is None:
        raise LoadError(f"{d}: no checkpoint ({ckpt.TRACKER} missing)")
    if not ckpt.is_complete(d / ckpt.iter_name(it)):
        raise LoadError(f"{d / ckpt.iter_name(it)}: missing or incomplete checkpoint")
    return d, it


def read_meta(ckpt_dir: Path) -> tuple[dict, int, dict]:
    """(arch, padded vocab, tokenizer block) from ``run_config.json``; plain Python."""
    rc = ckpt.read_run_config(ckpt_dir)
    if rc is None:
        raise LoadError(f"{ckpt_dir / ckpt.RUN_CONFIG}: missing, so the model's architecture is unknown")
    cfg = rc.get("config", {})
    if "model" not in cfg or "padded_vocab" not in cfg:
        raise LoadError(f"{ckpt_dir / ckpt.RUN_CONFIG}: no model/padded_vocab in config")
    tok = cfg.get("tokenizer") or cfg.get("data", {}).get("tokenizer") or {}
    return cfg["model"], int(cfg["padded_vocab"]), tok


def init_single_process(device: str = "cpu") -> None:
    """A one-process gloo/NCCL group + megatron model-parallel state (1, 1), unless already set up."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Apex|apex|Transformer Engine|TransformerEngine).*")
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
        if device.startswith("cuda"):
            tensor_parallel.model_parallel_cuda_manual_seed(1234)  # megatron initialises weights on the GPU
        else:
            tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def build(arch: dict, padded_vocab: int, device: str = "cpu", bf16: bool = False):
    from snakellm.models.architecture import build_model

    init_single_process(device)
    model, _ = build_model(arch, padded_vocab, device=device, bf16=bf16, fused_loss="eager", use_te=False)
    return model


def load(path: str | os.PathLike, iteration: int | None = None, device: str = "cpu", bf16: bool = False) -> LoadedModel:
    d, it = resolve_checkpoint(path, iteration)
    arch, vocab, tok = read_meta(d)
    model = build(arch, vocab, device=device, bf16=bf16)
    from megatron.core import dist_checkpointing

    ckpt._in_process_results_queue()
    sd = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(d / ckpt.iter_name(it)))
    model.load_state_dict(sd["model"], strict=False)
    model.eval()
    return LoadedModel(model, arch, vocab, tok, it, d / ckpt.iter_name(it), device)


def save_model_checkpoint(
    dest: str | os.PathLike, model, arch: dict, padded_vocab: int, tokenizer: dict, iteration: int = 0
) -> Path:
    """A model-only checkpoint (``model`` sharded state + common.pt) that :func:`load` and fine-tuning read."""
    import torch.distributed as dist

    p = Path(dest)
    d = p / "checkpoints" if not p.name == "checkpoints" else p
    d.mkdir(parents=True, exist_ok=True)
    write_json(d / ckpt.RUN_CONFIG, {
        "fingerprint": "imported",
        "config": {"model": arch, "padded_vocab": padded_vocab, "tokenizer": tokenizer,
                   "data": {"tokenizer": {k: tokenizer.get(k) for k in ("name", "kind", "vocab_size", "eod_id")}}},
    })
    return ckpt.save(d, iteration, {"model": model.sharded_state_dict(), "iteration": iteration}, rank=0, barrier=dist.barrier)


def tokenizer_from_blend(blend: str | os.PathLike) -> dict:
    """The tokenizer block of a blend.json (what a run was trained with)."""
    p = Path(blend)
    try:
        return json.loads(p.read_text())["tokenizer"]
    except (OSError, ValueError, KeyError) as e:
        raise LoadError(f"{p}: no tokenizer block: {e}") from None
