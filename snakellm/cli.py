"""``snakellm <step> ...``: one command per workflow step.

Each step is one module of :mod:`snakellm.steps` with ``build_parser()`` (its
flags, from the settings dataclasses) and ``main(argv)``, which calls the
implementation in its stage's package; so the same step runs from a rule, by
hand, under ``srun`` or inside a container, and also as ``python -m
snakellm.steps.<step>``. Modules are imported lazily: ``snakellm
chunk`` must not pay for importing torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

from snakellm.errors import SnakellmError

# step name -> (module, one-line summary)
STEPS: dict[str, tuple[str, str]] = {
    "download": ("snakellm.steps.download", "fetch a chunk's http shards with retries, resume and a sha256 manifest"),
    "chunk": ("snakellm.steps.chunk", "stream a chunk's shards into one validated jsonl (+ rejected lines, stats)"),
    "train-tokenizer": (
        "snakellm.steps.train_tokenizer",
        "train a SentencePiece tokenizer on a sample of the chunks",
    ),
    "tokenize": ("snakellm.steps.tokenize", "tokenize a chunk into Megatron .bin/.idx (MMIDIDX)"),
    "blend": ("snakellm.steps.blend", "write Megatron's data_prefix blend for a tokenizer"),
    "train": ("snakellm.steps.train", "pretrain a GPT with megatron-core (CPU or GPU, resumable)"),
    "prepare-sft": ("snakellm.steps.prepare_sft", "SQuAD json / jsonl -> {input, output} train/validation/test splits"),
    "finetune": (
        "snakellm.steps.finetune",
        "LoRA, full SFT or p-tuning of a pretrained run (answer-only loss, resumable)",
    ),
    "evaluate": (
        "snakellm.steps.evaluate",
        "generation on a test split: NeMo's test_exact_string_match and test_loss, SQuAD EM/F1",
    ),
    "compare-eval": ("snakellm.steps.compare_eval", "a fine-tune's base-vs-tuned table (json, tsv, markdown)"),
    "evaluate-lm": (
        "snakellm.steps.evaluate_lm",
        "lm-evaluation-harness on a Hugging Face export (or a server), local tasks only; builds the shipped suite",
    ),
    "lora": (
        "snakellm.steps.lora",
        "merge a LoRA adapter into its base, or write it in Hugging Face PEFT format",
    ),
    "plan": ("snakellm.steps.plan", "print the chunk plan of the configured sources"),
    "export-nemo": ("snakellm.steps.export_nemo", "write a .nemo (NeMo 1.x mcore GPT) that NeMo's restore_from loads"),
    "import-nemo": (
        "snakellm.steps.import_nemo",
        "import a .nemo that NeMo's save_to wrote into a model-only checkpoint",
    ),
    "launch": ("snakellm.steps.launch", "print the srun/torchrun/container command line the pretrain rule runs"),
    "export-hf": ("snakellm.steps.export_hf", "write a Hugging Face model directory (GPT-2 / Llama) from a checkpoint"),
    "random-hf": (
        "snakellm.steps.random_hf",
        "write a Hugging Face model directory of a preset's shape with random weights (no download)",
    ),
    "import-hf": (
        "snakellm.steps.import_hf",
        "turn a Hugging Face GPT-2 / Llama directory into a snakellm checkpoint",
    ),
    "generate": ("snakellm.steps.generate", "sample continuations of prompts from a checkpoint (KV-cached decoding)"),
    "serve": (
        "snakellm.steps.serve",
        "serve a checkpoint over HTTP: NeMo's PUT /generate and OpenAI's /v1/completions",
    ),
    "report": (
        "snakellm.steps.report",
        "plots and tables for `snakemake --report` (data, tokens, train, any metrics table)",
    ),
    "dag": (
        "snakellm.steps.dag",
        "draw the workflow's rule graph and job DAG as SVG (Graphviz, else a built-in renderer)",
    ),
}


def _usage() -> str:
    width = max(map(len, STEPS))
    lines = [
        "usage: snakellm <step> [options]   (snakellm <step> --help for a step's options)",
        "",
        "A Snakemake build system for LLM data and training; these are its steps:",
        "",
    ]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in STEPS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        from . import __version__

        print(__version__)
        return 0
    step = argv.pop(0)
    if step not in STEPS:
        print(f"snakellm: unknown step {step!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(STEPS[step][0])
    return run_step(f"snakellm {step}", module.main, argv)


def run_step(prog: str, step_main: Callable[[list[str]], int | None], argv: list[str]) -> int:
    """Run a step's ``main``; a :class:`SnakellmError` becomes one line on stderr and its exit status.

    Steps raise; this is the one place that turns their errors into the exit
    status contract of :mod:`snakellm.errors` (2: usage/config, nothing done;
    1: failed while working; 75: clean stop to resume), without a traceback.
    """
    try:
        return int(step_main(argv) or 0)
    except SnakellmError as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return e.exit_code


def one_line(err: BaseException) -> str:
    """The error's message on one line (a message may quote a multi-line input)."""
    return " ".join(str(err).split()) or type(err).__name__


if __name__ == "__main__":
    sys.exit(main())
