"""``snakellm train-tokenizer``: a SentencePiece model on a seeded sample (snakellm.tokenize.sentencepiece_trainer)."""

from __future__ import annotations

import argparse
import sys

from snakellm.config.sections import SampleSettings, TokenizerTrainSettings
from snakellm.config.settings import DefaultsHelpFormatter, add_arguments, from_namespace
from snakellm.io.log import plural
from snakellm.tokenize.sentencepiece_trainer import TrainError, train_sentencepiece


def build_parser() -> argparse.ArgumentParser:
    """The `snakellm train-tokenizer` flags (settings from snakellm.config.sections, with the config's defaults)."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm train-tokenizer",
        description="Train a SentencePiece model on a seeded sample of jsonl chunks "
        "(like train_sentencepiece_tokenizer.py --vocab_size 2000 on Botchan).",
    )
    p.add_argument("inputs", nargs="+", help="chunk .jsonl files, in a fixed order")
    p.add_argument(
        "--key",
        action="append",
        default=[],
        help="JSON text key: once for all inputs, or once per input in order (default text)",
    )
    p.add_argument("--model", required=True, help="output .model")
    p.add_argument("--vocab", help="output .vocab (default: the model path with .vocab)")
    p.add_argument("--stats", help="output stats json (default: the model path with .stats.json)")
    p.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        help="pieces in the model (exactly; an error if the text cannot give them)",
    )
    add_arguments(p.add_argument_group("training (config: tokenizers.NAME.train)"), TokenizerTrainSettings)
    add_arguments(p.add_argument_group("sample (config: tokenizers.NAME.train.sample)"), SampleSettings)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    train = from_namespace(TokenizerTrainSettings, a)
    keys = a.key or ["text"]
    if len(keys) == 1:
        keys = keys * len(a.inputs)
    if len(keys) != len(a.inputs):
        p.error(f"{len(a.inputs)} inputs but {len(keys)} --key values")
    model = a.model
    stem = model[: -len(".model")] if model.endswith(".model") else model
    try:
        st = train_sentencepiece(
            list(zip(a.inputs, keys)),
            model,
            a.vocab or stem + ".vocab",
            a.stats or stem + ".stats.json",
            vocab_size=a.vocab_size,
            model_type=train.model_type,
            character_coverage=train.character_coverage,
            normalization=train.normalization,
            byte_fallback=train.byte_fallback,
            user_defined_symbols=train.user_defined_symbols,
            max_sentence_length=train.max_sentence_length,
            max_bytes=a.max_bytes,
            seed=a.seed,
            threads=train.threads,
            options=train.options,
        )
    except (TrainError, OSError) as e:
        print(f"snakellm train-tokenizer: error: {e}", file=sys.stderr)
        return 1
    s = st["sample"]
    print(
        f"{model}: {st['vocab_size']} pieces ({st['settings']['model_type']}) from {s['sentences']} sentences, "
        f"{s['bytes'] / 1e6:.2f} MB sampled from {plural(len(s['inputs']), 'chunk')}, in {st['seconds']} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
