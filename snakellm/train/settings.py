"""Training settings: the one source of every ``runs.*.train`` and ``runs.*.parallel`` key.

Each setting is a dataclass field with its type, default, help text and two
facts about it:

* ``trajectory``: changing it makes old checkpoints a different training run
  (the batch size, the schedule, the seed ...). Only these enter the settings
  fingerprint stored with checkpoints; everything else (intervals, keep_last,
  max_time, workers, logging) may change between restarts.
* ``cli``: whether ``snakellm train`` takes it as a flag (``retries`` is a
  Snakemake rule setting, not a trainer one).

The framework (:func:`setting`, :func:`add_arguments`, :func:`to_flags` ...)
lives in :mod:`snakellm.config.settings`; from these dataclasses come the
``snakellm train`` flags, the pretrain rule's command line, the fingerprinted
keys (:data:`TRAJECTORY_KEYS`), and a test checks that ``config/schema.yaml``
has exactly these keys with exactly these defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from snakellm.config.settings import (  # noqa: F401  (re-exported: the framework's old home)
    REQUIRED,
    add_arguments,
    defaults,
    from_namespace,
    setting,
    to_flags,
)


@dataclass(frozen=True, kw_only=True)
class ResumeSettings:
    """What a restarted job does with the checkpoints it finds: the same two settings for every training job
    (``runs.<name>.train`` and ``finetune.<name>.train``), read by :mod:`snakellm.train.resume`."""

    resume: str = setting(
        "auto",
        "auto: from the latest checkpoint if any; require: fail without one; never: move "
        "checkpoints aside and start fresh",
        choices=("auto", "require", "never"),
    )
    on_config_change: str = setting(
        "archive",
        "checkpoints made with other trajectory settings: move them to checkpoints.old-<time>/ and "
        "start fresh (archive), or fail (error)",
        choices=("archive", "error"),
    )


@dataclass(frozen=True)
class TrainSettings(ResumeSettings):
    """``runs.<name>.train``: steps, batch, optimizer, schedule, checkpoints, stopping."""

    steps: int = setting(REQUIRED, "optimizer steps (iterations) in total")
    micro_batch_size: int = setting(REQUIRED, "sequences per rank per forward pass")
    global_batch_size: int = setting(
        REQUIRED, "sequences per step: micro batch x data-parallel size x gradient accumulation steps", trajectory=True
    )
    lr: float = setting(6.0e-4, "peak learning rate (AdamW)", trajectory=True)
    min_lr: float = setting(6.0e-5, "learning rate at the end of the decay", trajectory=True)
    warmup_steps: int = setting(0, "linear warmup steps", trajectory=True)
    decay_steps: int | None = setting(
        None,
        "step at which min-lr is reached (default: --steps); set it to extend a run later without changing "
        "its schedule",
        trajectory=True,
    )
    lr_decay_style: str = setting(
        "cosine", "learning-rate decay after warmup", trajectory=True, choices=("cosine", "linear", "constant")
    )
    weight_decay: float = setting(0.1, "decoupled weight decay (not on biases and norms)", trajectory=True)
    adam_beta1: float = setting(0.9, "AdamW beta1", trajectory=True)
    adam_beta2: float = setting(0.95, "AdamW beta2", trajectory=True)
    adam_eps: float = setting(1.0e-8, "AdamW epsilon", trajectory=True)
    clip_grad: float = setting(1.0, "gradient-norm clip (0: off)", trajectory=True)
    seed: int = setting(1234, "seeds the weights, the data order and dropout", trajectory=True)
    split: str = setting(
        "969,30,1", "train,valid,test shares of each token file's documents (Megatron --split)", trajectory=True
    )
    precision: str = setting(
        "auto",
        "auto: bf16 with fp32 master weights on GPU, fp32 on CPU",
        trajectory=True,
        choices=("auto", "bf16", "fp32"),
    )
    save_interval: int = setting(1000, "checkpoint every N steps (and at the end)")
    keep_last: int = setting(2, "keep the newest K checkpoints, plus the best by validation loss")
    eval_interval: int = setting(1000, "validation loss every N steps (and at every checkpoint)")
    eval_iters: int = setting(10, "validation batches per evaluation (0: none)")
    log_interval: int = setting(10, "metrics are fetched from the device and written every N steps")
    max_time: str | float | None = setting(
        None, "stop cleanly (checkpoint, exit status 75) after this long: seconds, 90m, 2h, HH:MM:SS, D-HH:MM:SS"
    )
    collective_timeout: float = setting(
        600.0,
        "seconds a rank may make no progress before it ends the job, naming the rank(s) it waits for "
        "(snakellm.launch.watchdog); the process group's own timeout is 60 s longer",
    )
    retries: int | None = setting(
        None,
        "attempts Snakemake adds after a failed or stopped (exit 75) attempt, each resuming from the latest "
        "checkpoint (null: the profile's `retries`)",
        cli=False,
    )


@dataclass(frozen=True)
class ParallelSettings:
    """``runs.<name>.parallel``: how the ranks split the model and the work."""

    tp: int = setting(1, "tensor-parallel size (on the CPU only for models without dropout)")
    pp: int = setting(1, "pipeline-parallel size (must be 1)")
    threads: int = setting(2, "CPU threads of the job (torch intra-op threads on CPU)")
    num_workers: int | None = setting(None, "data-loader workers per rank (null: 2 on GPU, 0 on CPU)")
    loss: str = setting(
        "auto",
        "cross-entropy: compiled (fused; GPU default), eager, or megatron-core's "
        "vocab-parallel one (needed for tp > 1)",
        choices=("auto", "compiled", "eager", "megatron"),
    )
    compile: bool = setting(False, "torch.compile each transformer layer (GPU)")
    sequence_parallel: bool = setting(
        False,
        "megatron-core sequence parallelism: the norms, dropouts, embedding output and residual stream are split "
        "along the sequence over the tensor-parallel ranks instead of replicated (needs tp > 1)",
    )
    distributed_optimizer: bool = setting(
        False,
        "shard the fp32 Adam states and master weights over the data-parallel ranks (megatron-core's "
        "distributed-optimizer gradient buffers: reduce-scatter, then all-gather of the updated weights)",
    )


TRAJECTORY_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TrainSettings) if f.metadata["trajectory"])
