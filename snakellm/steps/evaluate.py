"""``snakellm evaluate``: greedy generation on a test split and its metrics (snakellm.eval.evaluate)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from snakellm import tracking
from snakellm.config.sections import PACKING_ONLY, EvaluateSettings, ExamplesSettings
from snakellm.config.settings import DefaultsHelpFormatter, add_arguments
from snakellm.eval.evaluate import evaluate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm evaluate",
        description="Generation on a test split (greedy by default): NeMo's test_exact_string_match and test_loss, "
        "SQuAD EM/F1 -> metrics.json, predictions.jsonl ({input, pred, label, answers}) and NeMo's "
        "predictions_test_dataloader0_inputs_preds_labels.jsonl ({input, pred, label}).",
    )
    p.add_argument("--base", required=True, help="pretrained run (or a full fine-tune's model/ directory)")
    p.add_argument("--test", required=True, help="test split jsonl ({input, output[, answers]})")
    p.add_argument("--out-dir", required=True, help="directory for metrics.json and the predictions files")
    p.add_argument("--adapter", default=None, help="LoRA adapter directory (finetune's adapter/)")
    p.add_argument("--prompt", default=None, help="p-tuning directory (finetune's prompt/)")
    p.add_argument("--label", default=None, help="name of the evaluated model in metrics.json")
    add_arguments(p.add_argument_group("evaluation (config: finetune.NAME.evaluate)"), EvaluateSettings)
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where to run (default: %(default)s: cuda when available, else cpu)",
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--precision", default="auto", choices=("auto", "bf16", "fp32"), help="weights' dtype (default: %(default)s)"
    )
    examples = p.add_argument_group("examples, as in training (config: finetune.NAME.examples)")
    add_arguments(examples, ExamplesSettings, exclude=PACKING_ONLY)
    tracking.add_results_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from snakellm.finetune.dataset import SFTFormatError
    from snakellm.finetune.runtime import BaseModelError
    from snakellm.models.loading import LoadError

    a = build_parser().parse_args(argv)
    try:
        m = evaluate(a)
    except (SFTFormatError, BaseModelError, LoadError, FileNotFoundError) as e:
        print(f"snakellm evaluate: error: {e}", file=sys.stderr)
        return 2
    print(
        f"snakellm evaluate: {m['model']}: test_exact_string_match {m['test_exact_string_match']:.4f}, SQuAD EM "
        f"{m['squad_exact_match']:.4f} F1 {m['squad_f1']:.4f}, test_loss {m['test_loss']:.4f} "
        f"({m['examples']} examples)",
        file=sys.stderr,
    )
    # eval/<label>/<data set>/...: a run's base model is evaluated on each fine-tune's data set
    tracking.log_results(a.track_run, f"{a.label or 'eval'}/{Path(a.test).parent.name}", m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
