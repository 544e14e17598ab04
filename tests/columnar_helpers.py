"""A FineWeb-shaped corpus built here with pyarrow and datasets: what tests/test_columnar.py reads.

Several parquet files of 3-7 row groups in four codecs, texts in many scripts, CRLF line ends, a 240 KB document,
null texts, a file whose text column is ``content``, a file cut short, and a ``save_to_disk`` directory.
"""

from __future__ import annotations

import random
from pathlib import Path

SCRIPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "敏捷的棕色狐狸跳过了懒狗。日本語のテキストも少し。",
    "نص عربي قصير للاختبار، مع أرقام ١٢٣.",
    "हिन्दी में एक छोटा वाक्य।",
    "Ελληνικά κείμενα και עברית טקסט.",
    "emoji 🦊🐍 and tabs\tand\u00a0nbsp",
    "line one\r\nline two\r\nCRLF kept as is\r\n",
    'quotes " and backslashes \\ and </script>',
]
CODECS = ["snappy", "zstd", "gzip", "none"]


def fineweb_rows(rng: random.Random, n: int, file_no: int, with_nulls: bool = True) -> list[dict]:
    rows = []
    for i in range(n):
        k = rng.randrange(1, 6)
        text: str | None = " ".join(rng.choice(SCRIPTS) for _ in range(k))
        if with_nulls and i % 17 == 5:
            text = None
        rows.append(
            {
                "text": text,
                "id": f"<urn:uuid:{file_no:04d}-{i:06d}>",
                "dump": "CC-MAIN-2024-10",
                "url": f"https://example.org/{file_no}/{i}",
                "language_score": round(rng.random(), 4),
                "token_count": rng.randrange(10, 5000),
            }
        )
    return rows


def write_parquet(path: Path, rows: list[dict], row_groups: int, codec: str, rename: str | None = None) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tbl = pa.Table.from_pylist(rows)
    if rename:
        tbl = tbl.rename_columns([rename if c == "text" else c for c in tbl.column_names])
    per = -(-len(rows) // row_groups)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(tbl, path, row_group_size=per, compression=codec)


def make_corpus(root: Path, seed: int = 0) -> dict:
    """Write the corpus under ``root``; return what each part is, for the tests to compare against."""
    rng = random.Random(seed)
    files = []
    for f in range(4):
        n_rg = 3 + (f * 2) % 5  # 3, 5, 7, 4
        rows = fineweb_rows(rng, n_rg * 20, f)
        if f == 1:
            rows[7]["text"] = "long document " + "x" * 240_000  # a 240 KB document, one like any other
        p = root / "fineweb" / f"{f:03d}_00000.parquet"
        write_parquet(p, rows, n_rg, CODECS[f])
        files.append((p, n_rg, rows))
    renamed = root / "renamed" / "000.parquet"
    write_parquet(renamed, fineweb_rows(rng, 30, 9, with_nulls=False), 3, "zstd", rename="content")
    cut = root / "cut" / "000.parquet"
    write_parquet(cut, fineweb_rows(rng, 30, 8, with_nulls=False), 3, "snappy")
    data = cut.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    import datasets

    saved = root / "saved"
    srows = fineweb_rows(rng, 50, 7, with_nulls=False)
    datasets.Dataset.from_list(srows).save_to_disk(str(saved), num_shards=2)
    return {"files": files, "renamed": renamed, "cut": cut, "saved": saved, "saved_rows": srows}
