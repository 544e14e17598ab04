"""``snakellm tokenize``: a chunk into Megatron .bin/.idx (snakellm.tokenize.encode)."""

from __future__ import annotations

import argparse
import os
import sys

from snakellm.config.settings import DefaultsHelpFormatter
from snakellm.tokenize import encoders as tokmod
from snakellm.tokenize.encode import TokenizeError, tokenize_file


def build_parser() -> argparse.ArgumentParser:
    """The `snakellm tokenize` flags (settings from snakellm.config.sections, with the config's defaults)."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm tokenize",
        description="Tokenize a jsonl chunk into Megatron's MMIDIDX {prefix}.bin/.idx, with an EOD token "
        "after every document (preprocess_data.py --append-eod), plus {prefix}.stats.json.",
    )
    p.add_argument("input", help="the chunk's .jsonl (one JSON object per line)")
    p.add_argument("prefix", help="output prefix, e.g. data/tokens/gpt2/wikitext/chunk-00000_text_document")
    p.add_argument("--key", default="text", help="JSON key holding the document text (default text)")
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="encoder threads (default: all cores, here %(default)s)",
    )
    p.add_argument("--stats", help="default: {prefix}.stats.json")
    p.add_argument("--batch-mb", type=float, default=1.0, help="MB of json per encoded batch (default: %(default)s)")
    p.add_argument("--source", default="", help="source name, recorded in the stats")
    p.add_argument("--chunk", default="", help="chunk name, recorded in the stats")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--verify",
        type=float,
        default=0.005,
        help="fraction of documents whose tiktoken ids are compared with tokenizers' (huggingface kind; default 0.005; "
        "0: none); a difference re-encodes the chunk with tokenizers",
    )
    p.add_argument(
        "--verify-all-mb",
        type=float,
        default=2.0,
        help="compare every document when the chunk is at most this many MB (default: %(default)s)",
    )
    p.add_argument(
        "--allow-empty",
        action="store_true",
        help="an empty chunk (a curated one whose documents were all removed) is a dataset of no documents, "
        "not an error",
    )
    tokmod.add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        tok = tokmod.from_args(a)
        tok.prepare_threads(max(1, a.threads))
        print(f"snakellm tokenize: encoder {tok.backend}: {tok.encoder_reason or tok.kind}", file=sys.stderr)
        st = tokenize_file(
            a.input,
            a.prefix,
            tok,
            key=a.key,
            threads=a.threads,
            stats=a.stats,
            source=a.source,
            chunk=a.chunk,
            batch_bytes=max(1, int(a.batch_mb * 1e6)),
            show_progress=not a.no_progress,
            verify=a.verify,
            verify_all_bytes=int(a.verify_all_mb * 1e6),
            allow_empty=a.allow_empty,
        )
    except (tokmod.TokenizerError, TokenizeError, OSError) as e:
        print(f"snakellm tokenize: error: {e}", file=sys.stderr)
        return 1
    print(
        f"{a.prefix}: {st['documents']} documents, {st['tokens']} tokens ({st['dtype']}, "
        f"{st['tokenizer']['name']} via {st['tokenizer']['backend']}) in {st['seconds']} s, "
        f"{st['tokens_per_s'] or 0:,} tokens/s with {st['threads']} threads",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
