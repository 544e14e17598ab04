"""``snakellm finetune``: LoRA, full SFT or p-tuning of a pretrained run, one loop for all three.

The method only decides which parameters train and what the checkpoints hold:

* ``lora``: adapters on megatron-core's linears (snakellm.finetune.lora); base frozen;
  checkpoints and the optimizer hold only the adapters.
* ``full``: every weight trains; checkpoints hold the whole model.
* ``ptuning``: a prompt encoder makes N virtual tokens (snakellm.finetune.ptuning); base frozen.

Everything else is shared: NeMo-style SFT examples with answer-only loss
(snakellm.finetune.dataset), megatron-core DDP over data-parallel ranks (tensor
parallel on GPUs), AdamW with fp32 masters and the warmup + cosine schedule of
pretraining, validation loss every ``--eval-interval`` steps, the best
checkpoint kept, early stopping after ``--patience`` evaluations without an
improvement of ``--min-delta``. Checkpoints are Megatron-LM's
``iter_{N:07d}/`` (dist_checkpointing) with the trainable weights, optimizer,
RNG states and the data position; a killed run (SIGKILL included) resumes
from the latest one exactly: the same losses as an uninterrupted run.
SIGTERM/SIGUSR1 or ``--max-time`` stop after a checkpoint with exit status 75.

Outputs (from the best checkpoint): ``adapter/`` (LoRA: adapter.safetensors +
adapter_config.json), ``prompt/`` (p-tuning: the encoder and the virtual-token
table), ``model/`` (full: a checkpoint directory ``snakellm evaluate`` and the
exporters load like a pretrained run); ``metrics.jsonl`` and
``finetune_summary.json`` last.
"""

from __future__ import annotations

import argparse
import sys

from snakellm.config.settings import add_arguments
from snakellm.io import checkpoint as ckpt
from snakellm.train.settings import ResumeSettings

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_STOPPED = 0, 1, 2, 75
METHODS = ("lora", "full", "ptuning")


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("examples (as NeMo's GPTSFTDataset)")
    g.add_argument("--template", default="{input} {output}", help="prompt template; must end with {output}")
    g.add_argument("--max-seq-length", type=int, default=None, help="tokens per example (default: the model's)")
    g.add_argument("--add-bos", action=argparse.BooleanOptionalAction, default=False, help="BOS before the context")
    g.add_argument("--add-eos", action=argparse.BooleanOptionalAction, default=True, help="EOD after the answer")
    g.add_argument(
        "--answer-only-loss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="loss on the answer tokens only (the prompt is masked)",
    )
    g.add_argument(
        "--truncation-method",
        default="right",
        choices=("left", "right"),
        help="too long a context loses tokens from its end (right, NeMo's default) or its start (left)",
    )


def add_method_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA (NeMo's peft lora_tuning options)")
    g.add_argument("--lora-rank", type=int, default=32, help="adapter_dim")
    g.add_argument("--lora-alpha", type=float, default=None, help="scale = alpha / rank (default alpha = rank)")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="adapter_dropout")
    g.add_argument(
        "--lora-targets",
        default="linear_qkv",
        help="comma list of linear_qkv, linear_proj, linear_fc1, linear_fc2 (target_modules)",
    )
    g.add_argument(
        "--lora-layers", default=None, help="comma list of 1-based layer numbers (layer_selection; default all)"
    )
    g.add_argument("--lora-column-init", default="xavier", choices=("xavier", "normal", "kaiming", "zero"))
    g.add_argument("--lora-row-init", default="zero", choices=("xavier", "normal", "kaiming", "zero"))
    g.add_argument(
        "--lora-modules-to-save",
        default="",
        help="comma list of base modules trained whole beside the adapters (PEFT's modules_to_save): final_layernorm",
    )
    g = p.add_argument_group("p-tuning")
    g.add_argument("--virtual-tokens", type=int, default=10)
    g.add_argument("--prompt-encoder", default="mlp", choices=("mlp", "lstm"))
    g.add_argument("--prompt-encoder-hidden", type=int, default=2048)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="snakellm finetune",
        description="Fine-tune a pretrained run on {input, output} jsonl (prepare-sft) with LoRA, full SFT or "
        "p-tuning: answer-only loss, validation every N steps, best checkpoint kept, early stopping, exact resume.",
        epilog="exit status: 0 done; 1 error; 2 usage error; 75 stopped on a signal/--max-time after a checkpoint.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--base", required=True, help="pretrained run dir, its checkpoints/ or an iter_NNNNNNN/ dir")
    p.add_argument("--data-dir", required=True, help="directory with train.jsonl and validation.jsonl")
    p.add_argument("--out-dir", required=True, help="output directory (runs/RUN/finetune/TASK)")
    p.add_argument("--method", required=True, choices=METHODS)
    add_method_arguments(p)
    add_data_arguments(p)
    p.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="pack several examples into each sequence (block-diagonal attention, positions restart)",
    )
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--micro-batch-size", type=int, default=4)
    t.add_argument("--global-batch-size", type=int, default=8)
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--min-lr", type=float, default=0.0)
    t.add_argument("--warmup-steps", type=int, default=0)
    t.add_argument("--lr-decay-style", default="cosine", choices=("cosine", "linear", "constant"))
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.98)
    t.add_argument("--clip-grad", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"))
    c = p.add_argument_group("validation, checkpoints, stopping")
    c.add_argument("--eval-interval", type=int, default=50, help="validation loss every N steps (and a checkpoint)")
    c.add_argument("--eval-examples", type=int, default=0, help="validation examples per evaluation (0: all)")
    c.add_argument(
        "--patience", type=int, default=0, help="stop after this many evaluations without improvement (0: never)"
    )
    c.add_argument("--min-delta", type=float, default=0.001, help="improvement that resets the patience")
    c.add_argument(
        "--select",
        default="best",
        choices=("best", "last"),
        help="which checkpoint the artifacts come from: the best validation loss (NeMo's default) or the last",
    )
    c.add_argument("--keep-last", type=int, default=1, help="newest checkpoints kept (the best is always kept)")
    add_arguments(c, ResumeSettings)
    c.add_argument("--max-time", type=float, default=None, help="seconds; then checkpoint and exit 75")
    s = p.add_argument_group("parallelism")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPU)")
    s.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    s.add_argument("--no-checkpoints", dest="checkpoints", action="store_false", help="benchmarks only")
    s.add_argument("--pad-to-max", action="store_true", help="pad every batch to --max-seq-length (benchmarks)")
    return p


def method_config(a: argparse.Namespace):
    from snakellm.finetune.lora import LoRAConfig
    from snakellm.finetune.ptuning import PTuningConfig

    if a.method == "lora":
        layers = tuple(int(x) for x in a.lora_layers.split(",")) if a.lora_layers else None
        return LoRAConfig(
            rank=a.lora_rank,
            alpha=a.lora_alpha,
            dropout=a.lora_dropout,
            targets=tuple(t.strip() for t in a.lora_targets.split(",") if t.strip()),
            layers=layers,
            column_init=a.lora_column_init,
            row_init=a.lora_row_init,
            seed=a.seed,
            modules_to_save=tuple(m.strip() for m in a.lora_modules_to_save.split(",") if m.strip()),
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
        return finetune(a, method_config(a))
    except (SFTFormatError, BaseModelError, LoadError, JobError, ResumeError, ValueError, ckpt.CheckpointError) as e:
        print(f"snakellm finetune: error: {e}", file=sys.stderr)
        return EXIT_USAGE if not isinstance(e, ckpt.CheckpointError) else EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
