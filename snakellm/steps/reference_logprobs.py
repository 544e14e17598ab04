"""``snakellm reference-logprobs``: a frozen reference's log-probabilities of a preference set (for DPO)."""

from __future__ import annotations

import argparse
import sys

from snakellm.config.sections import DPO_TOKENIZATION, DpoSettings
from snakellm.config.settings import DefaultsHelpFormatter, add_arguments
from snakellm.errors import EXIT_USAGE

NOT_TOKENIZATION = tuple(k for k in DpoSettings.__dataclass_fields__ if k not in DPO_TOKENIZATION)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm reference-logprobs",
        description="The reference model's summed completion log-probabilities of every pair of every split "
        "(chosen and rejected), tokenized as the DPO fine-tune tokenizes them (TRL's DPOTrainer): the "
        "reference_logprobs file a DPO fine-tune reads. Depends only on the model, the pairs and their "
        "tokenization.",
    )
    p.add_argument(
        "--model", required=True, help="the reference: a run dir, its checkpoints/ or a full fine-tune's model/"
    )
    p.add_argument(
        "--adapter", default=None, help="a LoRA fine-tune's adapter/ on --model (its base run): base plus adapter"
    )
    p.add_argument("--data-dir", required=True, help="a prepared preference set (train/validation/test.jsonl)")
    p.add_argument("--out", required=True, help="the JSON file to write")
    add_arguments(
        p.add_argument_group("tokenization (config: finetune.NAME.dpo)"), DpoSettings, exclude=NOT_TOKENIZATION
    )
    p.add_argument("--max-seq-length", type=int, default=None, help="the fine-tune's examples.max_seq_length")
    p.add_argument("--chat-template", default=None, help="conversational pairs: the fine-tune's examples.chat_template")
    p.add_argument(
        "--precision", default="auto", choices=("auto", "fp32", "bf16"), help="auto: bf16 on GPU, fp32 on CPU"
    )
    p.add_argument("--batch-size", type=int, default=8, help="pairs per forward pass")
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where the reference runs (default: %(default)s)",
    )
    p.add_argument("--threads", type=int, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    from snakellm.finetune.dataset import SFTFormatError
    from snakellm.finetune.preference import PreferenceError
    from snakellm.finetune.reference import compute
    from snakellm.finetune.runtime import BaseModelError
    from snakellm.models.loading import LoadError

    a = build_parser().parse_args(argv)
    tokenization = {"max_length": a.dpo_max_length, "max_prompt_length": a.dpo_max_prompt_length}
    tokenization["truncation_mode"] = a.dpo_truncation_mode
    try:
        doc = compute(
            a.model,
            a.data_dir,
            a.out,
            tokenization,
            device=a.device,
            precision=a.precision,
            batch_size=a.batch_size,
            threads=a.threads,
            max_seq_length=a.max_seq_length,
            chat_template=a.chat_template,
            adapter=a.adapter,
        )
    except (SFTFormatError, PreferenceError, BaseModelError, LoadError, ValueError) as e:
        print(f"snakellm reference-logprobs: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    n = {k: len(v["kept"]) for k, v in doc["splits"].items()}
    print(f"snakellm reference-logprobs: {n} pairs in {doc['seconds']}s -> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
