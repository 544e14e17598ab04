"""``snakellm generate``: sample continuations of prompts from a checkpoint (snakellm.serve.generate)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from snakellm.config.sections import GenerateSettings
from snakellm.config.settings import DefaultsHelpFormatter, add_arguments, defaults, from_namespace
from snakellm.errors import SnakellmError
from snakellm.io.atomic import write_text
from snakellm.io.log import plural
from snakellm.serve.engine.settings import EngineSettings
from snakellm.serve.generate import GenerationError, SamplingParams, load_generator, params_summary


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """The prompts and sampling flags, with the config's defaults (snakellm.config.sections.GenerateSettings)."""
    add_arguments(p.add_argument_group("prompts and sampling (config: generate)"), GenerateSettings)


SAMPLING_REPETITION_PENALTY = 1.1  # repetition_penalty when sampling and none is given (greedy: off)


def params_from_args(a: argparse.Namespace) -> SamplingParams:
    """The sampling parameters; ``--greedy`` is the argmax of the logits unless a penalty is given."""
    rp = a.repetition_penalty
    if rp is None:
        rp = 1.0 if a.greedy else SAMPLING_REPETITION_PENALTY
    return SamplingParams(
        max_new_tokens=a.max_new_tokens,
        min_new_tokens=a.min_new_tokens,
        greedy=a.greedy,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        repetition_penalty=rp,
        end_strings=a.end_string or [],
        seed=a.seed,
    )


def build_parser() -> argparse.ArgumentParser:
    """The `snakellm generate` flags (settings from snakellm.config.sections, with the config's defaults)."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm generate",
        description="Continue prompts with a checkpoint (the continuous-batching engine: static KV cache, CUDA "
        "graphs on a GPU; any number of prompts). Prompts come from "
        "--prompt (repeatable) or --prompts-file (one per line, or jsonl with a 'prompt' key); the output is "
        "jsonl ({prompt, completion, finish_reason, tokens}) or, with --markdown, a readable report.",
    )
    p.add_argument("checkpoint", help="a run dir (runs/NAME), its checkpoints/ dir or one iter_NNNNNNN/ dir")
    p.add_argument(
        "--prompts-file",
        default=None,
        help="prompts, one per line (or .jsonl with 'prompt'); with it, the default prompts are not used",
    )
    p.add_argument("--out", default=None, help="write the jsonl here (atomically) instead of stdout")
    p.add_argument("--markdown", default=None, help="also write the samples as a markdown report here")
    p.add_argument("--blend", default=None, help="blend.json naming the tokenizer files (default: the run_config's)")
    p.add_argument("--iteration", type=int, default=None)
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where to run (default: %(default)s: cuda when available, else cpu)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--add-bos", action="store_true", help="prepend the BOS token to every prompt")
    add_sampling_arguments(p)
    add_arguments(p.add_argument_group("engine"), EngineSettings)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    prompts = list(a.prompt or ([] if a.prompts_file else defaults(GenerateSettings)["prompts"]))
    if a.prompts_file:
        path = Path(a.prompts_file)
        if not path.is_file():
            print(f"snakellm generate: {path}: prompts file not found", file=sys.stderr)
            return 2
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    prompts.append(json.loads(line)["prompt"])
                except (ValueError, KeyError, TypeError) as e:
                    print(f"snakellm generate: {path}:{n}: expected a JSON object with 'prompt': {e}", file=sys.stderr)
                    return 2
            else:
                prompts.append(line)
    if not prompts:
        print("snakellm generate: no prompts (--prompt or --prompts-file)", file=sys.stderr)
        return 2
    params = params_from_args(a)
    try:
        params.check()
        from snakellm.models.loading import LoadError, describe_run

        describe_run(a.checkpoint, a.iteration)
    except (GenerationError, LoadError, ValueError) as e:
        print(f"snakellm generate: {e}", file=sys.stderr)
        return 2
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.time()
    gen = load_generator(a.checkpoint, blend=a.blend, device=a.device, iteration=a.iteration)
    t1 = time.time()
    try:
        from snakellm.serve.engine import Engine

        outs = Engine(gen, from_namespace(EngineSettings, a)).generate(prompts, params, add_bos=a.add_bos)
    except (GenerationError, SnakellmError) as e:
        print(f"snakellm generate: {e}", file=sys.stderr)
        return 2
    t2 = time.time()
    ntok = sum(len(o.ids) for o in outs)
    lines = [
        json.dumps(
            {"prompt": pr, "completion": o.text, "finish_reason": o.finish_reason, "tokens": len(o.ids)},
            ensure_ascii=False,
        )
        for pr, o in zip(prompts, outs, strict=True)
    ]
    text = "".join(line + "\n" for line in lines)
    if a.out:
        write_text(a.out, text)
    else:
        sys.stdout.write(text)
    if a.markdown:
        md = [
            f"# Samples from `{a.checkpoint}`",
            "",
            f"{plural(len(prompts), 'prompt')}; {params_summary(params)}; {ntok} tokens in {t2 - t1:.2f} s.",
            "",
        ]
        for i, (pr, o) in enumerate(zip(prompts, outs, strict=True), 1):
            md += [f"## {i}", "", "```text", pr + o.text, "```", "", f"*{len(o.ids)} tokens, {o.finish_reason}*", ""]
        write_text(a.markdown, "\n".join(md))
    print(
        f"[{time.strftime('%H:%M:%S')}] {plural(len(prompts), 'prompt')}, {ntok} new tokens in {t2 - t1:.2f} s "
        f"({ntok / max(t2 - t1, 1e-9):.1f} tokens/s; loading {t1 - t0:.1f} s)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
