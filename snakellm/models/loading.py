"""Get a trained model back: :func:`load` (and :func:`save_model_checkpoint`, its inverse for imports).

Export, generation, serving, fine-tuning and evaluation read checkpoints only
through :func:`load`, so there is one place that knows how a run records its
architecture and tokenizer:

* ``checkpoints/run_config.json``: ``config.model`` (the resolved architecture),
  ``config.padded_vocab`` and, next to the config, ``tokenizer`` (the blend's
  tokenizer block: kind, files, vocab size, EOD id) and ``blend``;
* ``tokenizer/``: the tokenizer files the run was trained with and their manifest;
* ``checkpoints/iter_NNNNNNN/``: a megatron.core.dist_checkpointing directory;
  only its ``model`` part is read, so a training checkpoint (with optimizer
  and RNG states) and a model-only one (written by an import) load alike.

A run carries its tokenizer (``RUN_DIR/tokenizer/``, :mod:`snakellm.io.run_tokenizer`):
the tokenizer block :func:`describe_run` returns names those files by absolute
path, so a run loads, generates and exports from any working directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snakellm.errors import UsageError
from snakellm.io import checkpoint as ckpt
from snakellm.io import run_tokenizer
from snakellm.models.architecture import MODEL_KEYS, ModelConfigError, check_parallel, padded_vocab_size, resolve


class LoadError(UsageError, RuntimeError):
    """The path holds no loadable checkpoint; the message says what is missing."""


@dataclass
class LoadedModel:
    """A megatron-core GPTModel with what it was trained with."""

    model: Any  # megatron.core.models.gpt.GPTModel (eval mode)
    arch: dict[str, Any]
    padded_vocab_size: int
    tokenizer: dict[str, Any]
    iteration: int
    checkpoint: Path
    run_dir: Path
    device: Any = None
    config: Any = None  # megatron-core TransformerConfig (what DDP wraps the model with)

    @property
    def vocab_size(self) -> int:
        """The tokenizer's true vocabulary size (rows past it are Megatron's padding)."""
        return int(self.tokenizer.get("vocab_size") or self.padded_vocab_size)


def locate(path: str | os.PathLike, iteration: int | None = None) -> tuple[Path, int]:
    """(checkpoints dir, iteration) for a run dir, a checkpoints dir or an ``iter_NNNNNNN`` dir."""
    p = Path(path)
    if ckpt.ITER_RE.match(p.name):
        if iteration is not None and int(p.name[5:]) != iteration:
            raise LoadError(f"{p} is iteration {int(p.name[5:])}, not {iteration}")
        if not ckpt.is_complete(p):
            raise LoadError(f"{p} is not a complete checkpoint (no metadata.json/common.pt)")
        return p.parent, int(p.name[5:])
    ckpt_dir = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if not ckpt_dir.is_dir():
        raise LoadError(f"{path}: no such run or checkpoint directory")
    if iteration is None:
        latest = ckpt.latest_iteration(ckpt_dir)
        if latest is None:
            raise LoadError(f"{ckpt_dir}: no checkpoint saved yet (no {ckpt.TRACKER})")
        iteration = latest
    if not ckpt.is_complete(ckpt_dir / ckpt.iter_name(iteration)):
        have = ", ".join(map(str, ckpt.list_iterations(ckpt_dir))) or "none"
        raise LoadError(f"{ckpt_dir}: no complete checkpoint for iteration {iteration} (have: {have})")
    return ckpt_dir, iteration


def describe_run(
    path: str | os.PathLike, iteration: int | None = None, *, seq_length: int | None = None, tp: int = 1
) -> dict[str, Any]:
    """Everything :func:`load` needs except torch: checkpoint, architecture, vocab, tokenizer (torch-free).

    ``seq_length`` other than the model's: shorter is always possible, longer only with rotary
    positions (a learned position table has no rows past its length). ``tp``: the tensor-parallel
    size the model is to be built at (dist_checkpointing reshards the weights on load).
    """
    ckpt_dir, it = locate(path, iteration)
    rc = ckpt.read_run_config(ckpt_dir)
    if rc is None:
        raise LoadError(f"{ckpt_dir / ckpt.RUN_CONFIG} is missing: the checkpoint's architecture is unknown")
    cfg = rc.get("config", {})
    try:
        model = cfg.get("model", {})
        arch = resolve(None, {k: v for k, v in model.items() if k in MODEL_KEYS or k in _family_keys(model)})
    except ModelConfigError as e:
        raise LoadError(f"{ckpt_dir / ckpt.RUN_CONFIG}: {e}") from None
    try:
        tokenizer = run_tokenizer.resolve(ckpt_dir.parent, rc.get("tokenizer"))
    except run_tokenizer.RunTokenizerError as e:
        raise LoadError(str(e)) from None
    vocab = int(cfg.get("padded_vocab") or padded_vocab_size(int(tokenizer["vocab_size"]), arch))
    _fit(arch, vocab, seq_length, tp)
    return {
        "checkpoint_dir": ckpt_dir,
        "iteration": it,
        "arch": arch,
        "padded_vocab_size": vocab,
        "tokenizer": tokenizer,
        "run_dir": ckpt_dir.parent,
    }


def _family_keys(model: dict[str, Any]) -> tuple[str, ...]:
    """The architecture keys only the model's family has (Llama 3.x's rope scaling, Qwen2's qkv_bias)."""
    from snakellm.models import families

    style = model.get("style")
    return tuple(families.FAMILIES[style].arch_keys) if style in families.FAMILIES else ()


def _fit(arch: dict[str, Any], vocab: int, seq_length: int | None, tp: int) -> None:
    """Set the sequence length and check the tensor-parallel size, or say why the model cannot have them."""
    if seq_length is not None and seq_length != arch["seq_length"]:
        if arch["position_embedding"] == "learned" and seq_length > arch["seq_length"]:
            raise LoadError(
                f"sequence length {seq_length} is beyond the model's {arch['seq_length']} learned positions"
            )
        if arch["position_embedding"] != "learned":  # rotary positions: any length (not a weight)
            arch["seq_length"] = seq_length
    if vocab % tp:
        raise LoadError(f"padded vocabulary {vocab} is not divisible by tensor parallel size {tp}")
    try:
        check_parallel(arch, tp, 1)
    except ModelConfigError as e:
        raise LoadError(str(e)) from None


def load(
    path: str | os.PathLike,
    iteration: int | None = None,
    device: Any = "cpu",
    bf16: bool = False,
    *,
    tp: int = 1,
    seq_length: int | None = None,
    train: bool = False,
    **build_options: Any,
) -> LoadedModel:
    """The model of ``path`` at ``iteration`` (default: the latest): the one way a trained model comes back.

    Starts a single-process group and megatron-core's parallel state if none
    is running (export, generation); inside a training, fine-tuning or
    evaluation job it uses the job's: ``device`` is then the job's
    ``torch.device`` and ``tp`` its tensor-parallel size (this rank gets its
    shard). ``seq_length`` as in :func:`describe_run`. ``train``: leave the
    model in training mode (fine-tuning). ``build_options`` go to
    :func:`snakellm.models.build.build_model` (e.g. ``attention_backend``,
    ``fused_loss``).
    """
    info = describe_run(path, iteration, seq_length=seq_length, tp=tp)
    from snakellm.launch.runtime import ensure_single_process
    from snakellm.models.build import build_model

    dev = device if not isinstance(device, str) else ensure_single_process(device)
    model, config = build_model(
        info["arch"], info["padded_vocab_size"], tp=tp, device=str(dev), bf16=bf16, **build_options
    )
    loaded = ckpt.load(info["checkpoint_dir"], info["iteration"], {"model": model.sharded_state_dict()})
    model.load_state_dict(loaded["model"], strict=True)
    model.train(train)
    return LoadedModel(
        model=model,
        arch=info["arch"],
        padded_vocab_size=info["padded_vocab_size"],
        tokenizer=info["tokenizer"],
        iteration=info["iteration"],
        checkpoint=info["checkpoint_dir"] / ckpt.iter_name(info["iteration"]),
        run_dir=info["run_dir"],
        device=dev,
        config=config,
    )


def save_model_checkpoint(
    path: str | os.PathLike,
    model: Any,
    arch: dict[str, Any],
    padded_vocab: int,
    tokenizer: dict[str, Any],
    iteration: int = 0,
    extra: dict[str, Any] | None = None,
    sharded_state: dict[str, Any] | None = None,
) -> Path:
    """Write a model-only checkpoint that :func:`load` (and fine-tuning) read: the inverse for imports.

    ``path`` is a run dir (``runs/NAME``; the checkpoint goes to its
    ``checkpoints/``) or a checkpoints dir. Writes ``iter_{N:07d}/`` through a
    ``.partial`` directory, the tracker, and ``run_config.json`` with the
    architecture and the tokenizer. ``sharded_state``: the model's sharded state dict when
    ``model.sharded_state_dict()`` is not it (an FSDP-sharded model's, gathered).
    """
    import torch

    p = Path(path)
    ckpt_dir = p if p.name == "checkpoints" else p / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    config = {"model": dict(arch), "padded_vocab": int(padded_vocab), **(extra or {})}
    if rank == 0:
        tokenizer = run_tokenizer.carry(tokenizer, ckpt_dir.parent)  # the model dir carries its tokenizer
        ckpt.write_run_config(ckpt_dir, "import", config, tokenizer=tokenizer)
    msd = sharded_state if sharded_state is not None else model.sharded_state_dict()
    state = {"model": msd, "iteration": iteration, "checkpoint_version": 3.0}
    barrier = torch.distributed.barrier if torch.distributed.is_initialized() else (lambda: None)
    return ckpt.save(ckpt_dir, iteration, state, rank=rank, barrier=barrier)
