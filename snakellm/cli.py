"""``snakellm <step> ...``: one command per workflow step.

Each step is one module of :mod:`snakellm.steps` with ``build_parser()`` (its
flags, from the settings dataclasses) and ``main(argv)``, which calls the
implementation in its stage's package; so the same step runs from a rule, by
hand, under ``srun`` or inside a container, and also as ``python -m
snakellm.steps.<step>``. Modules are imported lazily: ``snakellm
chunk`` must not pay for importing torch.

Before a step is imported, :func:`snakellm.quiet.install` silences the library
warnings that tell the user nothing (``--verbose`` keeps them), and a mistyped
flag or step gets a did-you-mean (:func:`suggest`).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from collections.abc import Callable
from typing import NoReturn

from snakellm.errors import SnakellmError

# step name -> (module, one-line summary)
STEPS: dict[str, tuple[str, str]] = {
    "download": ("snakellm.steps.download", "fetch a chunk's http shards with retries, resume and a sha256 manifest"),
    "chunk": ("snakellm.steps.chunk", "stream a chunk's shards into one validated jsonl (+ rejected lines, stats)"),
    "curate-signatures": (
        "snakellm.steps.curate_signatures",
        "a chunk's filter verdicts, language, exact hash and MinHash values",
    ),
    "curate-buckets": ("snakellm.steps.curate_buckets", "one bucket job of a duplicate index: the duplicate pairs"),
    "curate-index": ("snakellm.steps.curate_index", "cluster an index's pairs into per-chunk removal lists"),
    "curate": ("snakellm.steps.curate", "a curated chunk: kept documents, removed ones with their reason, stats"),
    "train-tokenizer": (
        "snakellm.steps.train_tokenizer",
        "train a SentencePiece tokenizer on a sample of the chunks",
    ),
    "tokenize": ("snakellm.steps.tokenize", "tokenize a chunk into Megatron .bin/.idx (MMIDIDX)"),
    "blend": ("snakellm.steps.blend", "write Megatron's data_prefix blend for a tokenizer"),
    "train": ("snakellm.steps.train", "pretrain a GPT with megatron-core (CPU or GPU, resumable)"),
    "prepare-sft": ("snakellm.steps.prepare_sft", "SQuAD json / jsonl -> {input, output} train/validation/test splits"),
    "reference-logprobs": (
        "snakellm.steps.reference_logprobs",
        "a frozen reference's log-probabilities of a preference set's pairs (DPO's cached target)",
    ),
    "render-sft": (
        "snakellm.steps.render_sft",
        "the token ids and labels finetune trains on (chat template, loss mask), with --show",
    ),
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
    "track-data": ("snakellm.steps.track_data", "the data stages' counts as one W&B / MLflow data run"),
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
        "usage: snakellm [--verbose] <step> [options]   (snakellm <step> --help for a step's options)",
        "",
        "  --verbose  show every library warning and log line (default: only ours and those you can act on)",
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
    verbose = False
    while argv and argv[0] in ("--verbose", "-v"):
        verbose = bool(argv.pop(0))
    if not argv:
        print(_usage())
        return 0
    step = argv.pop(0)
    if step not in STEPS:
        print(f"snakellm: unknown step {step!r}{suggest([step], list(STEPS))}\n\n{_usage()}", file=sys.stderr)
        return 2
    from snakellm import quiet

    quiet.install(verbose)
    _step_argv[:] = argv
    argparse.ArgumentParser.error = _error_with_suggestion  # type: ignore[method-assign]
    try:  # every step's parser says which flag was meant: one hook here, not one per step
        module = importlib.import_module(STEPS[step][0])
        return run_step(f"snakellm {step}", module.main, argv)
    finally:
        argparse.ArgumentParser.error = _argparse_error  # type: ignore[method-assign]


def suggest(unknown: list[str], known: list[str]) -> str:
    """``"; did you mean --steps?"`` for unknown names close to a known one (difflib), else ``""``."""
    pairs = [(u, m[0]) for u in unknown if (m := difflib.get_close_matches(u, known, n=1, cutoff=0.6))]
    if not pairs:
        return ""
    if len(unknown) == 1:
        return f"; did you mean {pairs[0][1]}?"
    return "; did you mean " + ", ".join(f"{m} for {u}" for u, m in pairs) + "?"


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every long option of the parser and of its subcommands' parsers."""
    out = [s for s in parser._option_string_actions if s.startswith("--")]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _option_strings(sub)
    return sorted(set(out))


def unknown_flags(argv: list[str], known: list[str]) -> list[str]:
    """The ``--flags`` of ``argv`` (up to a ``--``) that are neither a known flag nor a prefix argparse expands."""
    out = []
    for a in argv:
        if a == "--":
            break
        name = a.split("=", 1)[0]
        if a.startswith("--") and not any(k.startswith(name) for k in known):
            out.append(name)
    return out


_step_argv: list[str] = []


def _error_with_suggestion(self: argparse.ArgumentParser, message: str) -> NoReturn:
    """argparse's error, with a did-you-mean for an unknown flag or subcommand (``--stepz``: ``--steps``).

    argparse reports missing required flags before unknown ones, so ``snakellm train --stepz 3``
    would only say that ``--steps`` is missing: the unknown flags of the step's command line are
    named (with their near match) whatever argparse's own complaint was.
    """
    known = _option_strings(self)
    unknown = unknown_flags(_step_argv, known)
    if message.startswith("unrecognized arguments: "):
        message += suggest(unknown, known)
    elif unknown:
        message += f"; unknown {'flag' if len(unknown) == 1 else 'flags'} {', '.join(unknown)}{suggest(unknown, known)}"
    if "invalid choice: " in message and (bad := message.split("invalid choice: ", 1)[1].split(" ", 1)[0]):
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                message += suggest([bad.strip("'")], list(action.choices))
    _argparse_error(self, message)


_argparse_error = argparse.ArgumentParser.error


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
