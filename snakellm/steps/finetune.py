"""``snakellm finetune``: LoRA, full SFT or p-tuning of a run (the recipe: snakellm.finetune.recipe)."""

from __future__ import annotations

import argparse
import sys

from snakellm import tracking
from snakellm.config.sections import (
    DpoSettings,
    ExamplesSettings,
    FinetuneParallelSettings,
    FinetuneSettings,
    FinetuneTrainSettings,
    LoraSettings,
    PtuningSettings,
)
from snakellm.config.settings import DefaultsHelpFormatter, add_arguments
from snakellm.errors import EXIT_FAILED, EXIT_USAGE
from snakellm.io import checkpoint as ckpt


def add_data_arguments(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """The example-building flags (config: finetune.NAME.examples), shared with ``snakellm evaluate``."""
    add_arguments(p.add_argument_group("examples (as NeMo's GPTSFTDataset)"), ExamplesSettings, exclude=exclude)


def add_method_arguments(p: argparse.ArgumentParser) -> None:
    add_arguments(p.add_argument_group("LoRA (NeMo's peft lora_tuning options)"), LoraSettings)
    add_arguments(p.add_argument_group("p-tuning"), PtuningSettings)
    d = p.add_argument_group("DPO (method dpo; TRL's DPOTrainer definitions)")
    add_arguments(d, DpoSettings)
    d.add_argument(
        "--reference-logprobs",
        default=None,
        metavar="FILE",
        help="the reference's log-probabilities of the pairs (snakellm reference-logprobs; not for dpo.reference "
        "adapter-off or loss simpo)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm finetune",
        description="Fine-tune a pretrained run on {input, output} jsonl (prepare-sft) with LoRA, full SFT or "
        "p-tuning, or on preference pairs with DPO (method dpo): answer-only loss, validation every N steps, best checkpoint kept, early stopping, exact resume.",
        epilog="exit status: 0 done; 1 error; 2 usage error; 75 stopped on a signal/--max-time after a checkpoint.",
    )
    p.add_argument("--base", required=True, help="pretrained run dir, its checkpoints/ or an iter_NNNNNNN/ dir")
    p.add_argument("--data-dir", required=True, help="directory with train.jsonl and validation.jsonl")
    p.add_argument("--out-dir", required=True, help="output directory (runs/RUN/finetune/TASK)")
    add_arguments(p, FinetuneSettings)
    add_method_arguments(p)
    add_data_arguments(p)
    add_arguments(p.add_argument_group("training"), FinetuneTrainSettings)
    c = p.add_argument_group("validation, checkpoints, stopping")
    c.add_argument("--max-time", type=float, default=None, help="seconds; then checkpoint and exit 75")
    s = p.add_argument_group("parallelism")
    add_arguments(s, FinetuneParallelSettings)
    s.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where to run (default: %(default)s: cuda when available, else cpu)",
    )
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show a progress bar")
    s.add_argument("--no-checkpoints", dest="checkpoints", action="store_false", help="benchmarks only")
    s.add_argument("--pad-to-max", action="store_true", help="pad every batch to --max-seq-length (benchmarks)")
    s.add_argument(
        "--profile-steps",
        default=None,
        metavar="A:B",
        help="torch.profiler over steps A..B; the kernel table goes to OUT_DIR/profile.txt",
    )
    tracking.add_arguments(p)
    return p


def method_config(a: argparse.Namespace):
    """The chosen method's configuration from its flags (None for a full fine-tune)."""
    from snakellm.finetune.lora import LoRAConfig
    from snakellm.finetune.ptuning import PTuningConfig

    if a.method == "lora" or (a.method == "dpo" and a.dpo_policy == "lora"):
        return LoRAConfig(
            rank=a.lora_rank,
            alpha=a.lora_alpha,
            dropout=a.lora_dropout,
            targets=tuple(t.strip() for t in a.lora_targets if t.strip()),
            layers=tuple(a.lora_layers) if a.lora_layers else None,
            column_init=a.lora_column_init,
            row_init=a.lora_row_init,
            seed=a.seed,
            modules_to_save=tuple(m.strip() for m in a.lora_modules_to_save if m.strip()),
        )
    if a.method == "ptuning":
        return PTuningConfig(
            virtual_tokens=a.virtual_tokens, encoder=a.prompt_encoder, hidden=a.prompt_encoder_hidden, seed=a.seed
        )
    return None


def main(argv: list[str] | None = None) -> int:
    from snakellm.finetune.dataset import SFTFormatError
    from snakellm.finetune.recipe import finetune
    from snakellm.finetune.runtime import BaseModelError
    from snakellm.models.loading import LoadError
    from snakellm.train.assembly import JobError
    from snakellm.train.resume import ResumeError

    a = build_parser().parse_args(argv)
    try:
        if a.profile_steps:
            from snakellm.train.profiling import parse_range

            parse_range(a.profile_steps)  # a bad range before anything is read
        return finetune(a, method_config(a))
    except (SFTFormatError, BaseModelError, LoadError, JobError, ResumeError, ValueError, ckpt.CheckpointError) as e:
        print(f"snakellm finetune: error: {e}", file=sys.stderr)
        return EXIT_USAGE if not isinstance(e, ckpt.CheckpointError) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
