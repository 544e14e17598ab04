"""The curated chunk: the chunk's documents minus the removed ones, lines unchanged.

Inputs: the chunk (``data/jsonl/{source}/{chunk}.jsonl``), its signature summary (the filter
verdicts: which rule each rejected document failed) and matrix, and its removal list from the
index (duplicates: reason, cluster, kept id). Outputs, written together (the stats last):

* ``data/curated/{source}/{chunk}.jsonl``: every kept line, byte for byte;
* ``{chunk}.removed.jsonl``: one ``{"id", "line", "reason", ...}`` per removed document with the
  original line as ``content`` (a duplicate also has ``cluster`` and ``kept``; a language_id
  rejection ``language`` and ``confidence``), as the chunk's quarantine file does;
* ``{chunk}.stats.json``: documents in and kept, removed by reason (each filter rule by name).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import numpy as np

from snakellm.curate.index import read_list
from snakellm.curate.signatures import load
from snakellm.errors import DataError
from snakellm.io.atomic import atomic_group


def curate_chunk(
    chunk_jsonl: str,
    sig_npy: str,
    sig_json: str,
    removal_list: str,
    output: str,
    removed_path: str,
    stats_path: str,
    *,
    source: str = "",
    chunk: str = "",
) -> dict[str, Any]:
    t0 = time.perf_counter()
    with open(sig_json, encoding="utf-8") as fh:
        sig_summary = json.load(fh)
    verdict = np.asarray(load(sig_npy)[0])
    rules = sig_summary["rules"]
    langs = sig_summary.get("rejected_language", {})
    dups = read_list(removal_list)
    by_reason: Counter[str] = Counter()
    kept = n = bytes_in = bytes_out = 0
    with atomic_group(output, removed_path, stats_path) as (out_tmp, rem_tmp, stats_tmp):
        with open(chunk_jsonl, "rb") as src, open(out_tmp, "wb") as out, open(rem_tmp, "wb") as rem:
            for i, line in enumerate(src):
                n += 1
                bytes_in += len(line)
                if i >= len(verdict):
                    raise DataError(
                        f"{chunk_jsonl} line {i + 1}: the chunk has more documents than its signatures "
                        f"({sig_npy}: {len(verdict)}); it changed after they were computed"
                    )
                entry: dict[str, Any] | None = None
                doc = f"{source}/{chunk}:{i}"
                if verdict[i]:
                    entry = {"id": doc, "line": i + 1, "reason": rules[int(verdict[i]) - 1]}
                    if str(i) in langs:
                        entry["language"], entry["confidence"] = langs[str(i)]
                elif i in dups:
                    reason, cluster, kept_id = dups[i]
                    entry = {"id": doc, "line": i + 1, "reason": reason, "cluster": cluster, "kept": kept_id}
                if entry is None:
                    out.write(line)
                    kept += 1
                    bytes_out += len(line)
                    continue
                by_reason[entry["reason"]] += 1
                entry["content"] = line.rstrip(b"\n").decode("utf-8", "surrogateescape")
                rem.write(json.dumps(entry, ensure_ascii=False).encode("utf-8", "surrogateescape") + b"\n")
        if n != len(verdict):
            raise DataError(f"{chunk_jsonl}: {n} documents, but {sig_npy} has signatures of {len(verdict)}")
        stats = {
            "source": source,
            "chunk": chunk,
            "documents_in": n,
            "documents": kept,
            "removed": n - kept,
            "removed_by_reason": dict(sorted(by_reason.items())),
            "languages": sig_summary.get("languages", {}),
            "bytes_in": bytes_in,
            "bytes": bytes_out,
            "seconds": round(time.perf_counter() - t0, 3),
        }
        stats_tmp.write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return stats
