"""``snakellm train``: pretrain a GPT on a blend with megatron-core, resumably.

One command for every launch: alone (CPU or one GPU), under ``torchrun``, under
``srun`` or ``mpirun``; ranks come from the environment (snakellm.launch.distributed).
Everything that can be wrong with the request is checked before torch is
imported (:mod:`snakellm.train.request`) and reported with the numbers;
``--dry-run`` stops there and prints the layout, the resume decision and the
memory per GPU (``--nodes``/``--gpus-per-node`` describe the job to come).

The flags are derived from the settings dataclasses (model:
:class:`snakellm.models.ModelSettings`; training and parallelism:
:mod:`snakellm.train.settings`), the same ones the config schema and the
pretrain rule use. Checkpoints (:mod:`snakellm.io.checkpoint`) are
Megatron-LM's ``iter_{N:07d}/`` + ``latest_checkpointed_iteration.txt``; a
restarted run resumes exactly where an uninterrupted one would be; after an
incompatible settings change the old checkpoints are moved aside or the run
fails, as ``--on-config-change`` says, never silently reused.

Exit status:

  0   the run reached --steps (final checkpoint, metrics.jsonl, train_summary.json written)
  1   an error during training
  2   a usage or configuration error, found before training started
  75  stopped early on SIGTERM/SIGUSR1 or --max-time, after saving a checkpoint:
      run the same command again (retry / requeue) to continue
"""

from __future__ import annotations

import argparse
import sys

from snakellm import models, tracking
from snakellm.config.settings import DefaultsHelpFormatter, add_arguments
from snakellm.io import checkpoint as ckpt
from snakellm.launch import distributed as distmod
from snakellm.launch import runtime
from snakellm.models.attention import ATTENTION_BACKENDS
from snakellm.train.assembly import JobError
from snakellm.train.dataset import DataError
from snakellm.train.request import RequestError, make_request
from snakellm.train.resume import ResumeError
from snakellm.train.settings import ParallelSettings, TrainSettings

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_STOPPED = 0, 1, 2, 75


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm train",
        description=(
            "Pretrain a GPT with megatron-core on a tokenizer's blend.json, resumably. Ranks come from the "
            "environment (torchrun, srun or mpirun); checkpoints go to RUN_DIR/checkpoints/iter_{N:07d}/ as "
            "Megatron-LM writes them, metrics to RUN_DIR/metrics.jsonl and TensorBoard to RUN_DIR/tensorboard/."
        ),
        epilog=(
            "exit status: 0 done; 1 training error; 2 usage/configuration error (found before training); "
            "75 stopped on SIGTERM/SIGUSR1/--max-time after saving a checkpoint: rerun to resume."
        ),
    )
    p.add_argument("--blend", required=True, help="blend.json of the tokenized data (data_prefix + tokenizer)")
    p.add_argument("--run-dir", required=True, help="output directory of the run (runs/NAME)")
    p.add_argument("--run-name", default=None, help="name for logs and the summary (default: RUN_DIR's name)")

    g = p.add_argument_group("model (a preset, then any single key overridden)")
    g.add_argument("--preset", default=None, choices=sorted(models.PRESETS), help="named model preset")
    add_arguments(g, models.ModelSettings)
    add_arguments(p.add_argument_group("training"), TrainSettings)
    s = p.add_argument_group("parallelism and speed")
    add_arguments(s, ParallelSettings)
    s.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where to run (default: %(default)s: cuda when available, else cpu)",
    )
    s.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="scaled_dot_product_attention kernel (auto: torch's choice)",
    )
    s.add_argument("--peak-tflops", type=float, default=None, help="per-GPU peak for MFU (default: from the GPU name)")

    c = p.add_argument_group("checking a request before submitting it")
    c.add_argument(
        "--dry-run",
        action="store_true",
        help="check everything (settings, batch against the parallel layout, blend, checkpoints) and print the "
        "layout, the resume decision and the memory per GPU, then exit 0: torch is not imported, nothing is written",
    )
    c.add_argument(
        "--nodes", type=int, default=None, help="with --dry-run: the job's nodes (default: the launcher's world)"
    )
    c.add_argument("--gpus-per-node", type=int, default=None, help="with --dry-run: ranks (GPUs) per node (default: 1)")
    c.add_argument(
        "--config",
        default=None,
        help="with --dry-run: take the job's nodes and GPUs per node from this workflow config's allocation of "
        "the run (runs.<--run-name>.resources, resources.pretrain, the Slurm profile's site defaults) and print it",
    )
    c.add_argument(
        "--gpu-memory-gib", type=float, default=80.0, help="with --dry-run: one GPU's memory, for the fits line"
    )

    o = p.add_argument_group("output")
    o.add_argument(
        "--tensorboard", action=argparse.BooleanOptionalAction, default=True, help="write TensorBoard events"
    )
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show a progress bar")
    o.add_argument(
        "--no-checkpoints",
        dest="checkpoints",
        action="store_false",
        help="save no checkpoints at all (benchmarks only: nothing to resume from)",
    )
    o.add_argument(
        "--profile-steps",
        default=None,
        metavar="A:B",
        help="torch.profiler over steps A..B; the kernel table goes to RUN_DIR/profile.txt",
    )
    tracking.add_arguments(p)
    return p


def _configured_job(args: argparse.Namespace):  # -> snakellm.config.jobs.Allocation
    """The run's job allocation in the workflow config ``--config`` (with the site's environment defaults)."""
    import os
    from pathlib import Path

    from snakellm.config import jobs
    from snakellm.config import validate as cfgmod

    name = args.run_name or Path(args.run_dir).name
    cfg = cfgmod.load(args.config, Path(__file__).resolve().parents[2] / "config" / "schema.yaml")
    if name not in cfg.get("runs", {}):
        raise ValueError(
            f"{args.config}: no run {name!r} under runs (runs: {', '.join(cfg.get('runs', {})) or 'none'})"
        )
    return jobs.allocation(cfg, "pretrain", name, os.environ)


def _error(e: Exception) -> None:
    print(f"snakellm train: error: {e}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    env = None
    job = None
    if args.config is not None:
        if not args.dry_run:
            parser.error("--config describes the job for --dry-run; a run takes its ranks from the launcher")
        try:
            job = _configured_job(args)
        except (OSError, ValueError) as e:  # ConfigError is a ValueError
            _error(e)
            return EXIT_USAGE
        args.nodes = args.nodes or job.nodes
        args.gpus_per_node = args.gpus_per_node or job.gpus_per_node or 1
    if args.nodes is not None or args.gpus_per_node is not None:
        if not args.dry_run:
            parser.error(
                "--nodes/--gpus-per-node describe the job for --dry-run; a run takes its ranks from the launcher"
            )
        if min(args.nodes or 1, args.gpus_per_node or 1) < 1:
            parser.error("--nodes and --gpus-per-node must be >= 1")
        nodes, per_node = args.nodes or 1, args.gpus_per_node or 1
        env = {"RANK": "0", "WORLD_SIZE": str(nodes * per_node), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(per_node)}
    try:
        req = make_request(args, env)
        if args.profile_steps:
            from snakellm.train.profiling import parse_range

            parse_range(args.profile_steps)
        if args.dry_run:
            from snakellm.train.request import dry_run

            lines = dry_run(req, args.nodes, args.gpus_per_node, args.gpu_memory_gib)
            if job is not None:
                lines.insert(2, f"  job ({job.where}): {job.describe()}")
            print("\n".join(lines))
            return EXIT_OK
    except (
        RequestError,
        ValueError,
        models.ModelConfigError,
        DataError,
        distmod.LaunchError,
        ckpt.CheckpointError,
    ) as e:
        _error(e)
        return EXIT_USAGE
    from snakellm.train.pretrain import pretrain

    try:
        return pretrain(req)
    except (
        RequestError,
        ResumeError,
        JobError,
        runtime.LaunchError,
        models.ModelConfigError,
        DataError,
        ckpt.CheckpointError,
    ) as e:
        _error(e)
        return EXIT_USAGE if isinstance(e, (RequestError, ResumeError, JobError, runtime.LaunchError)) else EXIT_ERROR
    except FloatingPointError as e:
        _error(e)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
