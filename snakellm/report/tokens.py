"""Tokens report: tokens per source and tokenizer, the blend actually used,
tokens per document, and what a tokenizer does to real text.

Inputs are the tokenize stats (``{prefix}.stats.json``), ``blend.json`` and the
``.idx`` files (document lengths; the ``.bin`` token data is never read).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from snakellm.tokenize.indexed import read_index

from . import html as H
from . import plots
from .data import ReportInputError, read_json


def load_blend(path: str) -> dict:
    blend = read_json(path)
    for k in ("tokenizer", "datasets", "sources", "tokens"):
        if k not in blend:
            raise ReportInputError(f"{path}: not a blend.json (no {k})")
    return blend


def document_lengths(idx_files: list[str]) -> dict[str, np.ndarray]:
    """Tokens per document (EOD included), per source, from the ``.idx`` files.

    A document is the sequences between two document indices (one sequence per
    document with ``--append-eod``); the source is the directory the file lies in.
    """
    out: dict[str, list[np.ndarray]] = {}
    for f in idx_files:
        idx = read_index(f)
        lengths = idx.lengths.astype(np.int64)
        docs = idx.document_indices.astype(np.int64)
        if len(docs) < 2:
            continue
        per_doc = np.add.reduceat(lengths, docs[:-1]) if len(lengths) else np.zeros(0, np.int64)
        per_doc[docs[:-1] == docs[1:]] = 0  # reduceat repeats a value for empty ranges
        out.setdefault(Path(f).parent.name, []).append(per_doc)
    return {s: np.concatenate(v) for s, v in out.items()}


SOURCE_COLUMNS = [
    "source",
    "chunks",
    "documents",
    "tokens",
    "tokens/doc (mean)",
    "median",
    "longest",
    "bytes/token",
    "weight (config)",
    "share of tokens",
    "share in blend",
]
CHUNK_COLUMNS = [
    "source",
    "chunk",
    "documents",
    "tokens",
    "text bytes",
    "empty docs",
    "tokens/s (tokenize)",
    "blend weight",
    "prefix",
]


def read_stats(stats_files: list[str]) -> dict[str, dict]:
    """The tokenize stats by output prefix: the key blend.json's datasets name them by."""
    stats = {}
    for p in stats_files:
        st = read_json(p)
        if "tokens" not in st or "prefix" not in st:
            raise ReportInputError(f"{p}: not a tokenize stats file")
        stats[st["prefix"]] = st
    return stats


def source_rows(blend: dict, stats: dict[str, dict], lengths: dict[str, np.ndarray]) -> tuple[list, list]:
    """One row per source and the "all" row; bytes/token needs the stats, which blend.json does not carry."""
    text_bytes: dict[str, int] = {}
    for d in blend["datasets"]:
        text_bytes[d["source"]] = text_bytes.get(d["source"], 0) + int(
            stats.get(d["prefix"], {}).get("text_bytes") or 0
        )
    total_tokens = blend["tokens"] or 1
    rows = []
    for s, v in blend["sources"].items():
        lens = lengths.get(s, np.zeros(0))
        rows.append(
            [
                s,
                v["chunks"],
                v["documents"],
                v["tokens"],
                round(v["tokens"] / max(1, v["documents"]), 1),
                int(np.median(lens)) if len(lens) else None,
                int(lens.max()) if len(lens) else None,
                round(text_bytes.get(s, 0) / v["tokens"], 3) if v["tokens"] and text_bytes.get(s) else None,
                v["weight"],
                f"{100 * v['tokens'] / total_tokens:.2f}%",
                f"{100 * v['share']:.2f}%",
            ]
        )
    total = [
        "all",
        sum(r[1] for r in rows),
        sum(r[2] for r in rows),
        sum(r[3] for r in rows),
        round(sum(r[3] for r in rows) / max(1, sum(r[2] for r in rows)), 1),
        None,
        None,
        round(sum(text_bytes.values()) / total_tokens, 3) if sum(text_bytes.values()) else None,
        "",
        "100%",
        "100%",
    ]
    return rows, total


def chunk_rows(blend: dict, stats: dict[str, dict]) -> list[list]:
    """One row per dataset of the blend, in blend order, with what its tokenize stats add."""
    return [
        [
            d["source"],
            d["chunk"],
            d["documents"],
            d["tokens"],
            stats.get(d["prefix"], {}).get("text_bytes"),
            stats.get(d["prefix"], {}).get("empty_documents"),
            stats.get(d["prefix"], {}).get("tokens_per_s"),
            round(d["weight"], 6),
            d["prefix"],
        ]
        for d in blend["datasets"]
    ]


def tokenizer_info(blend: dict) -> list[tuple[str, object]]:
    """The tokenizer as blend.json records it: what a reader needs to reproduce Megatron's flags."""
    tok = blend["tokenizer"]
    return [
        ("name", tok.get("name")),
        ("kind", tok.get("kind")),
        ("vocab size", tok.get("vocab_size")),
        ("EOD", f"{tok.get('eod_token')} (id {tok.get('eod_id')})"),
        ("token dtype", tok.get("dtype")),
        ("files", ", ".join(f"{k}: {v}" for k, v in (tok.get("files") or {}).items())),
        ("Megatron flags", " ".join(tok.get("megatron_args") or [])),
        ("tokens", blend["tokens"]),
        ("documents", blend.get("documents")),
    ]


def tokenizer_tables(blend: dict, stats_files: list[str], lengths: dict[str, np.ndarray]) -> str:
    """The tokens page of one tokenizer: its record, a table per source and a table per chunk."""
    stats = read_stats(stats_files)
    rows, total = source_rows(blend, stats, lengths)
    return H.page(
        f"Tokens: {blend['tokenizer'].get('name')}",
        H.section("Tokenizer", H.key_values(tokenizer_info(blend))),
        H.section(
            "Per source",
            H.table(SOURCE_COLUMNS, rows, total),
            note="share in blend = tokens x weight, normalised: what Megatron samples from (blend.json data_prefix).",
        ),
        H.section("Per chunk", H.table(CHUNK_COLUMNS, chunk_rows(blend, stats))),
    )


def blend_plot(blend: dict, path: str) -> None:
    sources = list(blend["sources"])
    total = blend["tokens"] or 1
    fig, axes = plots.figure(width=7.5, height=max(2.6, 1.2 + 0.55 * len(sources)))
    ax = axes[0][0]
    y = np.arange(len(sources))
    tok_share = [100 * blend["sources"][s]["tokens"] / total for s in sources]
    blend_share = [100 * blend["sources"][s]["share"] for s in sources]
    ax.barh(y - 0.2, tok_share, height=0.4, label="share of tokens")
    ax.barh(y + 0.2, blend_share, height=0.4, label="share in blend (x weight)")
    for yi, a, b in zip(y, tok_share, blend_share, strict=False):
        ax.text(a, yi - 0.2, f" {a:.1f}%", va="center", fontsize=8)
        ax.text(b, yi + 0.2, f" {b:.1f}%", va="center", fontsize=8)
    ax.set_yticks(y, [f"{s} (w={blend['sources'][s]['weight']:g})" for s in sources])
    ax.invert_yaxis()
    ax.set_xlabel("% of the tokenizer's tokens")
    ax.set_xlim(0, max(tok_share + blend_share) * 1.18)
    ax.set_title(f"{blend['tokenizer'].get('name')}: {blend['tokens']:,} tokens; blend weights actually used")
    ax.legend(fontsize=8, loc="lower right")
    plots.save(fig, path)


def lengths_plot(name: str, lengths: dict[str, np.ndarray], path: str) -> None:
    fig, axes = plots.figure(width=7.5, height=3.8)
    ax = axes[0][0]
    allv = np.concatenate(list(lengths.values())) if lengths else np.zeros(0)
    allv = allv[allv > 0]
    if len(allv):
        lo, hi = max(1, int(allv.min())), int(allv.max())
        bins = np.unique(np.geomspace(lo, max(hi, lo + 1) + 1, 40).astype(int))
        for s, v in lengths.items():
            v = v[v > 0]
            ax.hist(
                v,
                bins=bins,
                histtype="stepfilled",
                alpha=0.45,
                label=f"{s} ({len(v):,} docs, median {int(np.median(v)):,})",
            )
        ax.set_xscale("log")
        ax.legend(fontsize=8)
    else:
        plots.empty_note(ax, "no documents")
    ax.set_xlabel("tokens per document (EOD included), log scale")
    ax.set_ylabel("documents")
    ax.set_title(f"{name}: tokens per document")
    plots.save(fig, path)


def overview(blends: list[str], out_html: str, out_svg: str) -> None:
    loaded = [load_blend(b) for b in blends]
    sources = sorted({s for b in loaded for s in b["sources"]})
    names = [b["tokenizer"].get("name") or Path(p).parent.name for b, p in zip(loaded, blends, strict=False)]
    cols = [
        "tokenizer",
        "kind",
        "vocab size",
        *[f"{s} tokens" for s in sources],
        "total tokens",
        "documents",
        "tokens/doc",
    ]
    rows = [
        [
            n,
            b["tokenizer"].get("kind"),
            b["tokenizer"].get("vocab_size"),
            *[b["sources"].get(s, {}).get("tokens") for s in sources],
            b["tokens"],
            b.get("documents"),
            round(b["tokens"] / max(1, b.get("documents") or 1), 1),
        ]
        for n, b in zip(names, loaded, strict=False)
    ]
    H_page = H.page(
        "Tokens: all tokenizers",
        H.table(cols, rows),
        note="The same documents under each tokenizer: fewer tokens per document = a tokenizer that "
        "compresses this text better.",
    )
    from snakellm.io.atomic import write_text

    write_text(out_html, H_page)
    fig, axes = plots.figure(width=7.5, height=3.6)
    ax = axes[0][0]
    x = np.arange(len(sources))
    width = 0.8 / max(1, len(loaded))
    for i, (n, b) in enumerate(zip(names, loaded, strict=False)):
        vals = [b["sources"].get(s, {}).get("tokens", 0) for s in sources]
        bars = ax.bar(x + (i - (len(loaded) - 1) / 2) * width, vals, width=width, label=n)
        ax.bar_label(bars, labels=[f"{v / 1e3:,.0f}k" if v >= 1e3 else str(v) for v in vals], fontsize=7)
    ax.set_xticks(x, sources)
    ax.set_ylabel("tokens")
    ax.set_title("tokens per source and tokenizer")
    ax.legend(fontsize=8)
    plots.save(fig, out_svg)


def example_texts(jsonl: str, key: str, n: int = 4, chars: int = 160) -> list[str]:
    """The first line of the first ``n`` documents (up to ``chars``): real text from the data."""
    out = []
    with open(jsonl, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            try:
                text = json.loads(line)[key]
            except (ValueError, KeyError, TypeError):
                raise ReportInputError(f"{jsonl}:{lineno}: no {key!r} text") from None
            first = next((t.strip() for t in text.splitlines() if len(t.strip()) > 20), text.strip())
            if first:
                out.append(first[:chars])
            if len(out) >= n:
                break
    return out


def tokenizer_page(tok, texts: list[str], train_stats: str | None) -> str:
    from snakellm.tokenize.encoders import sha256_file

    info = [
        ("name", tok.name),
        ("kind", tok.kind),
        ("backend", tok.backend),
        ("vocab size", tok.vocab_size),
        ("EOD", f"{tok.eod_token} (id {tok.eod_id})"),
    ]
    info += [(f"file: {k}", f"{v} (sha256 {sha256_file(v)[:16]}…)") for k, v in tok.files.items()]
    parts = [H.section("Tokenizer", H.key_values(info))]
    if train_stats:
        st = read_json(train_stats)
        sample = st.get("sample", {})
        inputs = sample.get("inputs", [])
        parts.append(
            H.section(
                "Training (SentencePiece)",
                H.key_values(
                    [
                        ("settings", st.get("settings")),
                        ("seed", st.get("seed")),
                        ("threads", st.get("threads")),
                        ("sample: documents", sum(i.get("sampled", 0) for i in inputs)),
                        ("sample: sentences", sample.get("sentences")),
                        ("sample: bytes", sample.get("bytes")),
                        ("keep probability", sample.get("keep_probability")),
                        ("seconds", st.get("seconds")),
                    ]
                ),
                H.table(
                    ["sampled chunk", "key", "documents", "sampled"],
                    [[i.get("input"), i.get("key"), i.get("documents"), i.get("sampled")] for i in inputs],
                ),
            )
        )
    rows = []
    for t in texts:
        ids = tok.encode(t)
        pieces = "".join(f'<span class="piece">{H.esc(tok.decode([i]))}</span>' for i in ids)
        rows.append(
            [t, len(t.encode()), len(ids), H.Raw(pieces, "pieces"), H.Raw(f"<pre>{' '.join(map(str, ids))}</pre>")]
        )
    parts.append(
        H.section(
            "Example encodings",
            H.table(["text (from the data)", "bytes", "tokens", "pieces", "ids"], rows),
            note="The first line of the first documents of the first chunk, encoded as `snakellm tokenize` encodes them "
            "(each box is one token, decoded alone).",
        )
    )
    return H.page(f"Tokenizer: {tok.name}", *parts)
