"""``snakellm evaluate-lm``: lm-evaluation-harness on a Hugging Face export, local data only (snakellm.eval.lm_harness).

``--build-tasks DIR`` instead writes the shipped suite (snakellm.eval.lm_tasks): its jsonl files and
lm-eval task YAMLs, built deterministically from resources/.
"""

from __future__ import annotations

import argparse
import sys

from snakellm import tracking
from snakellm.config.sections import LmEvalSuiteSettings
from snakellm.config.settings import DefaultsHelpFormatter, add_arguments, from_namespace
from snakellm.errors import UsageError
from snakellm.eval.lm_tasks import SQUAD, WIKIPEDIA
from snakellm.io.log import log


def build_parser() -> argparse.ArgumentParser:
    """The `snakellm evaluate-lm` flags (a suite's settings from snakellm.config.sections, with the config's defaults)."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm evaluate-lm",
        description="Run lm-evaluation-harness (its `hf` model; `local-completions` with --base-url) on a Hugging "
        "Face model directory and write lm-eval's own results and per-document samples as one JSON file. "
        "Tasks read local files only: the Hugging Face offline switches are set. With --build-tasks DIR, write "
        "the shipped suite's task YAMLs and jsonl files (built from resources/) into DIR instead.",
    )
    p.add_argument("model", nargs="?", help="a Hugging Face model directory (runs/NAME/hf)")
    p.add_argument("--out", help="the results JSON (written atomically), e.g. runs/NAME/lm_eval/SUITE.json")
    p.add_argument("--suite", default="default", help="the suite's name, recorded in the JSON")
    p.add_argument(
        "--build-tasks", metavar="DIR", default=None, help="write the shipped tasks into DIR and stop (no model)"
    )
    p.add_argument("--wikipedia", default=WIKIPEDIA, help="--build-tasks: the MediaWiki dump of the held-out articles")
    p.add_argument("--squad", default=SQUAD, help="--build-tasks: the SQuAD-format file of the QA task")
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where to run (default: %(default)s: cuda when available, else cpu)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--base-url",
        default=None,
        help="evaluate a `snakellm serve` server instead (lm-eval's local-completions model on this "
        "/v1/completions URL; MODEL is then only the tokenizer)",
    )
    p.add_argument(
        "--model-name",
        default=None,
        help="with --base-url: the served model's name (default: the run's, the parent of a runs/NAME/hf directory)",
    )
    p.add_argument(
        "--max-length", type=int, default=None, help="context length (default: the model's; give it with --base-url)"
    )
    add_arguments(p.add_argument_group("suite (config: lm_eval.suites.NAME)"), LmEvalSuiteSettings)
    tracking.add_results_argument(p)
    return p


def _run_name(model_dir: str) -> str:
    """`snakellm serve runs/NAME` serves the model as NAME: the name of runs/NAME/hf's parent."""
    from pathlib import Path

    p = Path(model_dir).resolve()
    return p.parent.name if p.name == "hf" else p.name


def _device(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_tasks(out_dir: str, wikipedia: str, squad: str) -> int:
    """The shipped suite into ``out_dir`` (its inputs must exist: named if not)."""
    from pathlib import Path

    from snakellm.eval.lm_tasks import build_default_suite

    for f in (wikipedia, squad):
        if not Path(f).is_file():
            raise UsageError(f"{f}: not found (the shipped suite is built from it)")
    counts = build_default_suite(out_dir, wikipedia=wikipedia, squad=squad)
    log(f"lm-eval tasks in {out_dir}: " + ", ".join(f"{t} {n} documents" for t, n in counts.items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.build_tasks:
        return build_tasks(a.build_tasks, a.wikipedia, a.squad)
    if not a.model or not a.out:
        raise UsageError("give MODEL and --out (or --build-tasks DIR)")
    from snakellm.eval.lm_harness import HarnessRequest, go_offline, run_harness, summary_rows, write_results

    go_offline()  # before torch/transformers are imported
    suite = from_namespace(LmEvalSuiteSettings, a)
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    req = HarnessRequest(
        model_dir=a.model,
        tasks=list(suite.tasks),
        include_path=list(suite.include_path),
        num_fewshot=suite.num_fewshot,
        limit=suite.limit,
        batch_size=suite.batch_size,
        bootstrap_iters=suite.bootstrap_iters,
        seed=suite.seed,
        device=_device(a.device),
        base_url=a.base_url,
        served_name=a.model_name or _run_name(a.model),
        max_length=a.max_length,
    )
    result = run_harness(req)
    result["snakellm"]["suite"] = a.suite
    write_results(a.out, result)
    for task, metric, value, n in summary_rows(result):
        log(f"{a.suite}: {task} {metric} {value:.4f} ({n} documents)")
    log(f"wrote {a.out} ({result['snakellm']['seconds']} s)")
    tracking.log_results(a.track_run, f"lm_eval/{a.suite}", result.get("results", {}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
