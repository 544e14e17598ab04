#!/usr/bin/env python3
"""Benchmark: curation (snakellm.curate) beside datatrove's MinHash pipeline, on one corpus, the same parameters,
the same cores, in one run.

The corpus: the shipped texts (WikiText-2 articles split at their sections, Botchan's sections, the Wikipedia
excerpt's articles), with planted near duplicates of a share of them (a few words edited, paragraphs reordered,
boilerplate appended, the end cut off, exact copies) and hard negatives (halves of two documents joined),
split into jsonl chunks. The true Jaccard similarity of every pair of documents (5-word shingles of datatrove's
normalised text) is computed by brute force (a sparse product).

Printed, each beside its bar:
* recall: pairs at Jaccard >= 0.85 of which ours removed at least one (bar >= 95%), with our defaults;
* precision: removed documents farther than Jaccard 0.7 from every kept one (bar <= 2%);
* agreement: the Jaccard of ours' and datatrove's removed sets, ours run with datatrove's parameters
  (5-grams, 14 bands x 8 rows, no threshold) and datatrove's scheme (near.scheme: datatrove: its signatures
  and its kept document) (bar >= 95%); and, as an extra line, ours with its own scheme (near.scheme: snakellm);
* documents/s per core of each stage (signatures, index, curated chunks / datatrove's four stages) and of the
  whole, ours with its own scheme (bar: >= 2x datatrove's) and with datatrove's, and of the quality filters
  (the same four datatrove filters, run by ours and by a datatrove pipeline);
* the MinHash libraries (rensa, datatrove's permutations, datasketch) on the same shingles: speed and
  agreement of their Jaccard estimates with the truth;
* language ID (pycld2, py3langid): accuracy and speed on the shipped multilingual sample
  (resources/langid/, if present).

usage: python scripts/bench_curate.py [--scale N] [--cores 2] [--smoke] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from snakellm.curate import apply, filters, index, minhash, signatures  # noqa: E402

BOILERPLATE = (
    "Share this article on Facebook, Twitter or by e-mail. Copyright 2024 Example Media. All rights reserved. "
    "Subscribe to our newsletter for more stories like this one and follow us for updates."
)
NGRAM, BANDS, ROWS = 5, 14, 8  # datatrove's MinhashConfig defaults


# ---------------------------------------------------------------- corpus


def base_documents(smoke: bool) -> list[str]:
    """The shipped texts as documents of at least 60 words."""
    import zstandard

    docs: list[str] = []
    for shard in sorted((REPO / "resources/corpus/wikitext").glob("chunk*/*.jsonl.zst")):
        raw = zstandard.ZstdDecompressor().decompressobj().decompress(shard.read_bytes())
        for line in raw.splitlines():
            text = json.loads(line)["text"]
            part: list[str] = []
            for para in text.split("\n"):
                if para.startswith(" = = ") and part:
                    docs.append("\n".join(part))
                    part = []
                part.append(para)
            docs.append("\n".join(part))
    for line in (REPO / "resources/corpus/botchan/botchan.jsonl").read_text().splitlines():
        docs.append(json.loads(line)["text"])
    if not smoke:
        from snakellm.data.mediawiki import iter_pages

        for page in iter_pages(str(REPO / "resources/wikipedia/enwiki-pages-articles-excerpt.xml.bz2")):
            if not page.skip and page.text:
                docs.append(page.text)
    docs = [d for d in docs if len(d.split()) >= 60]
    return docs[:120] if smoke else docs


def variant(doc: str, kind: str, rng: random.Random) -> str:
    words = doc.split(" ")
    if kind == "exact":
        return doc
    if kind == "edit":  # a few words replaced or dropped: about 1 in 100
        out = list(words)
        for i in rng.sample(range(len(out)), max(1, len(out) // 100)):
            out[i] = rng.choice(["edited", "", "changed"])
        return " ".join(w for w in out if w)
    if kind == "reorder":
        paras = doc.split("\n")
        if len(paras) < 3:
            half = len(words) // 2
            return " ".join(words[half:] + words[:half])
        rng.shuffle(paras)
        return "\n".join(paras)
    if kind == "boilerplate":
        return doc + "\n" + BOILERPLATE
    if kind == "truncate":  # the last ~5% cut off
        return " ".join(words[: max(1, int(len(words) * 0.95))])
    raise ValueError(kind)


def make_corpus(smoke: bool, scale: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """(documents, how each was made): base documents, near duplicates of 40% of them, hard negatives."""
    rng = random.Random(seed)
    base = base_documents(smoke)
    docs: list[str] = []
    kinds: list[str] = []
    for rep in range(scale):
        # each repetition re-edits the base documents, so repetitions are near duplicates of each other too
        for d in base:
            docs.append(d if rep == 0 else variant(d, "edit", rng))
            kinds.append("base" if rep == 0 else "edit-of-base")
            if rng.random() < 0.4:
                k = rng.choice(["exact", "edit", "edit", "reorder", "boilerplate", "truncate"])
                docs.append(variant(d, k, rng))
                kinds.append(k)
        for _ in range(len(base) // 10):  # hard negatives: halves of two documents
            a, b = rng.sample(base, 2)
            wa, wb = a.split(" "), b.split(" ")
            docs.append(" ".join(wa[: len(wa) // 2] + wb[len(wb) // 2 :]))
            kinds.append("halves")
    order = list(range(len(docs)))
    rng.shuffle(order)
    return [docs[i] for i in order], [kinds[i] for i in order]


def write_chunks(docs: list[str], folder: Path, n: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(docs) // n)
    paths = []
    for c in range(n):
        p = folder / f"chunk-{c:05d}.jsonl"
        with open(p, "w") as fh:
            for i in range(c * per, min(len(docs), (c + 1) * per)):
                fh.write(json.dumps({"id": f"d{i}", "text": docs[i]}) + "\n")
        paths.append(str(p))
    return paths


# ---------------------------------------------------------------- truth


def shingle_matrix(docs: list[str]):
    from scipy.sparse import csr_matrix

    vocab: dict[tuple[str, ...], int] = {}
    indptr, indices = [0], []
    for d in docs:
        w = minhash.simplify(d).split()
        grams = {tuple(w[i : i + NGRAM]) for i in range(len(w) - NGRAM + 1)} or ({tuple(w)} if w else set())
        indices += sorted(vocab.setdefault(g, len(vocab)) for g in grams)
        indptr.append(len(indices))
    data = np.ones(len(indices), dtype=np.float32)
    return csr_matrix((data, indices, indptr), shape=(len(docs), len(vocab)))


def true_similarity(docs: list[str]):
    """Sparse upper-triangle matrix of Jaccard similarities >= 0.5 (brute force over all pairs)."""
    from scipy.sparse import coo_matrix, triu

    a = shingle_matrix(docs)
    sizes = np.asarray(a.sum(axis=1)).ravel()
    inter = triu((a @ a.T).tocoo(), k=1).tocoo()
    jac = inter.data / (sizes[inter.row] + sizes[inter.col] - inter.data)
    keep = jac >= 0.5
    return coo_matrix((jac[keep], (inter.row[keep], inter.col[keep])), shape=(len(docs), len(docs))).tocsr()


def quality(sim, removed: set[int], n: int) -> dict[str, float]:
    """Recall at Jaccard >= 0.85 and the share of removed documents farther than 0.7 from every kept one."""
    coo = sim.tocoo()
    hi = coo.data >= 0.85
    pairs = list(zip(coo.row[hi].tolist(), coo.col[hi].tolist()))
    found = sum(1 for i, j in pairs if i in removed or j in removed)
    sym = (sim + sim.T).tocsr()
    kept = np.ones(n, dtype=bool)
    kept[list(removed)] = False
    far = 0
    for r in removed:
        row = sym.getrow(r)
        near = row.indices[(row.data >= 0.7) & kept[row.indices]]
        far += len(near) == 0
    return {
        "pairs_085": len(pairs),
        "recall_085": found / max(1, len(pairs)),
        "removed": len(removed),
        "removed_far": far / max(1, len(removed)),
    }


# ---------------------------------------------------------------- ours


def _sig_job(args):
    path, out, cur = args
    signatures.compute(path, out, out[:-4] + ".json", cur, show_progress=False)


def _bucket_job(args):
    sigs, out, j, jobs, cur = args
    index.buckets(sigs, out, job=j, jobs=jobs, exact=cur["exact"], near=cur["near"])


def _apply_job(args):
    path, sig, lst, work, name = args
    apply.curate_chunk(
        path, sig, sig[:-4] + ".json", lst, *(f"{work}/cur-{name}{e}" for e in (".jsonl", ".r.jsonl", ".s.json"))
    )


def run_ours(paths: list[str], work: Path, cur: dict, cores: int) -> tuple[set[int], dict[str, float]]:
    work.mkdir(parents=True, exist_ok=True)
    names = [Path(p).stem for p in paths]
    sigs = [str(work / f"{n}.npy") for n in names]
    lists = [str(work / f"{n}.list.json") for n in names]
    t: dict[str, float] = {}
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(cores) as pool:
        t0 = time.perf_counter()
        pool.map(_sig_job, [(p, s, cur) for p, s in zip(paths, sigs)])
        t["signatures"] = time.perf_counter() - t0
        jobs = cores
        pair_files = [str(work / f"pairs-{j}.npy") for j in range(jobs)]
        t0 = time.perf_counter()
        pool.map(_bucket_job, [(sigs, pair_files[j], j, jobs, cur) for j in range(jobs)])
        index.cluster(sigs, [("b", n) for n in names], pair_files, lists, str(work / "index.json"))
        t["index"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        pool.map(_apply_job, [(p, s, lst, str(work), n) for p, s, lst, n in zip(paths, sigs, lists, names)])
        t["curated chunks"] = time.perf_counter() - t0
    removed: set[int] = set()
    for n in names:
        for line in open(work / f"cur-{n}.r.jsonl"):
            removed.add(int(json.loads(json.loads(line)["content"])["id"][1:]))
    return removed, t


# ---------------------------------------------------------------- datatrove


DT_WORKER = r"""
import json, sys, time
from loguru import logger
logger.remove()
# datatrove 0.10 hashes str shingles with xxhash < 4 (its `processing` extra pins it); xxhash 4 takes bytes only
import xxhash as _xx
import datatrove.utils.hashes.xxhash as _dx
_dx.xxhash64 = lambda d: _xx.xxh64_intdigest(d.encode() if isinstance(d, str) else d)
_dx.xxhash32 = lambda d: _xx.xxh32_intdigest(d.encode() if isinstance(d, str) else d)
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.dedup import MinhashDedupSignature, MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter
from datatrove.pipeline.dedup.minhash import MinhashConfig
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from snakellm.curate.filters import split_tokenizer, make_filter
a = json.loads(sys.argv[1])
inp, work, cores, files = a["input"], a["work"], a["cores"], a["files"]
tok = split_tokenizer()
cfg = MinhashConfig(n_grams=a["ngram"], num_buckets=a["bands"], hashes_per_bucket=a["rows"], seed=1)
def run(pipeline, tasks, name):
    t0 = time.perf_counter()
    LocalPipelineExecutor(pipeline, tasks=tasks, workers=min(cores, tasks), logging_dir=f"{work}/logs/{name}",
                          start_method="fork").run()
    return time.perf_counter() - t0
reader = lambda: JsonlReader(inp, glob_pattern="*.jsonl", compression=None, id_key="id")
t = {}
if a["mode"] == "minhash":
    t["signatures"] = run([reader(), MinhashDedupSignature(f"{work}/sigs", config=cfg, language=tok)], files, "s1")
    t["buckets"] = run([MinhashDedupBuckets(f"{work}/sigs", f"{work}/buckets", config=cfg)], cfg.num_buckets, "s2")
    t["cluster"] = run([MinhashDedupCluster(f"{work}/buckets", f"{work}/remove", config=cfg, save_cluster_id=True)],
                       1, "s3")
    t["filter"] = run([reader(), MinhashDedupFilter(f"{work}/remove", load_cluster_ids=True,
                       exclusion_writer=JsonlWriter(f"{work}/removed", compression=None)),
                       JsonlWriter(f"{work}/kept", compression=None)], files, "s4")
else:
    steps = [make_filter(n, {}) for n in ("gopher_repetition", "gopher_quality", "c4", "fineweb")]
    t["filters"] = run([reader(), *steps, JsonlWriter(f"{work}/filtered", compression=None)], files, "f")
print("@@" + json.dumps(t))
"""


def run_datatrove(inp: Path, work: Path, cores: int, files: int, mode: str = "minhash") -> tuple[set[int], dict]:
    arg = {"input": str(inp), "work": str(work), "cores": cores, "files": files, "mode": mode}
    arg.update(ngram=NGRAM, bands=BANDS, rows=ROWS)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", DT_WORKER, json.dumps(arg)], capture_output=True, text=True, env=env)
    if p.returncode != 0 or "@@" not in p.stdout:
        sys.exit(f"datatrove failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    t = json.loads(p.stdout.split("@@", 1)[1])
    removed: set[int] = set()
    clusters: dict[int, list[int]] = {}
    if mode == "minhash":
        for sub in ("removed", "kept"):
            for f in sorted((work / sub).glob("*.jsonl")):
                for line in open(f):
                    d = json.loads(line)
                    i = int(d["id"][1:])
                    if sub == "removed":
                        removed.add(i)
                    c = d.get("metadata", {}).get("minhash_cluster_id", -1)
                    if c != -1:
                        clusters.setdefault(c, []).append(i)
    t["_clusters"] = clusters
    return removed, t


def first_kept(clusters: dict[int, list[int]]) -> set[int]:
    """The removed set of these clusters when each keeps its first document in corpus order (ours' choice)."""
    return {i for members in clusters.values() for i in sorted(members)[1:]}


# ---------------------------------------------------------------- pieces


def bench_backends(docs: list[str], sim) -> list[str]:
    """The MinHash libraries on the same shingle hashes: speed and error of their Jaccard estimates."""
    grams, off = minhash.shingle_hashes([minhash.simplify(d) for d in docs], NGRAM)
    coo = sim.tocoo()
    sel = coo.data >= 0.5
    rows, cols, true = coo.row[sel], coo.col[sel], coo.data[sel]
    lines = []
    for b in minhash.BACKENDS:
        t0 = time.perf_counter()
        v = getattr(minhash, f"minhash_{b}")(grams, off, BANDS * ROWS, 1)
        dt = time.perf_counter() - t0
        est = (v[rows] == v[cols]).mean(axis=1)
        mae = float(np.abs(est - true).mean()) if len(true) else 0.0
        lines.append(
            f"  {b:<11} {len(docs) / dt:10,.0f} docs/s (MinHash of given shingles, 1 core)   "
            f"mean |estimate - true Jaccard| over {len(true)} pairs >= 0.5: {mae:.3f}   memory {v.nbytes / len(docs):.0f} B/doc"
        )
    return lines


def bench_langid() -> list[str]:
    sample = REPO / "resources" / "langid" / "postgres-messages.jsonl"
    if not sample.exists():
        return ["  (resources/langid/postgres-messages.jsonl not present)"]
    rows = [json.loads(line) for line in sample.read_text().splitlines()]
    paras = [
        {"lang": rows[i]["lang"], "text": " ".join(r["text"] for r in rows[i : i + 4])} for i in range(0, len(rows), 4)
    ]
    langs = len({r["lang"] for r in rows})
    lines = []
    for model in ("pycld2", "py3langid"):
        ident = filters.language_identifier(model)
        for what, items in (("messages", rows), ("paragraphs of 4", paras)):
            t0 = time.perf_counter()
            got = [ident(r["text"])[0] for r in items]
            dt = time.perf_counter() - t0
            acc = sum(g == r["lang"] for g, r in zip(got, items)) / len(items)
            lines.append(
                f"  {model:<10} {what:<16} accuracy {acc:6.1%} on {len(items)} texts in {langs} languages, "
                f"{len(items) / dt:8,.0f} texts/s"
            )
    return lines


def bench_filters(paths: list[str], docs: list[str], inp: Path, work: Path, cores: int) -> list[str]:
    cfg = {"filters": {n: {} for n in ("gopher_repetition", "gopher_quality", "c4", "fineweb")}}
    sub = docs[: max(50, len(docs) // 4)]
    judge = filters.build(cfg)
    t0 = time.perf_counter()
    for d in sub:
        judge.verdict(d)
    ours = len(sub) / (time.perf_counter() - t0)
    _, t = run_datatrove(inp, work, cores, len(paths), mode="filters")
    theirs = len(docs) / t["filters"] / min(cores, len(paths))
    return [f"  filters (4 datatrove filters): ours {ours:8,.0f} docs/s per core, datatrove's pipeline {theirs:8,.0f}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=int, default=3, help="repetitions of the base documents (re-edited each time)")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="a few hundred documents: seconds, the same code path")
    ap.add_argument("--out", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--keep", type=Path, help="work here and keep it")
    a = ap.parse_args()
    if a.smoke:
        a.scale, a.chunks = 1, 2
    work = a.keep or Path(tempfile.mkdtemp(prefix="snakellm-bench-curate-"))
    try:
        docs, kinds = make_corpus(a.smoke, a.scale)
        paths = write_chunks(docs, work / "chunks", a.chunks)
        n = len(docs)
        t0 = time.perf_counter()
        sim = true_similarity(docs)
        print(
            f"corpus: {n} documents ({kinds.count('base')} base, {n - kinds.count('base')} planted), {a.chunks} chunks; "
            f"{sim.nnz} pairs at Jaccard >= 0.5 by brute force in {time.perf_counter() - t0:.1f} s; {a.cores} cores"
        )

        near = {"threshold": 0.8, "ngram": NGRAM, "bands": BANDS, "rows": ROWS, "seed": 1}
        ours_removed, _ = run_ours(paths, work / "ours", {"exact": True, "near": near}, a.cores)
        q = quality(sim, ours_removed, n)
        fig: dict = {"documents": n, "cores": a.cores, "ours_defaults": q}
        print("\nquality, ours with its defaults (5-grams, 14 x 8, threshold 0.8):")
        print(f"  recall: {q['recall_085']:.1%} of {q['pairs_085']} pairs at Jaccard >= 0.85 found   (bar >= 95%)")
        print(f"  removed {q['removed']}; farther than 0.7 from every kept: {q['removed_far']:.2%}   (bar <= 2%)")

        dt_params = {**near, "threshold": 0.0}
        ours_dt, t_ours = run_ours(paths, work / "ours-dt", {"exact": False, "near": dt_params}, a.cores)
        compat = {**dt_params, "scheme": "datatrove"}
        ours_cp, t_cp = run_ours(paths, work / "ours-compat", {"exact": False, "near": compat}, a.cores)
        dt_removed, t_dt = run_datatrove(work / "chunks", work / "datatrove", a.cores, a.chunks)
        dt_first = first_kept(t_dt.pop("_clusters"))

        def jac(x: set[int], y: set[int]) -> float:
            return len(x & y) / max(1, len(x | y))

        agree, agree_own, agree_first = jac(ours_cp, dt_removed), jac(ours_dt, dt_removed), jac(ours_dt, dt_first)
        qd, qo, qc = quality(sim, dt_removed, n), quality(sim, ours_dt, n), quality(sim, ours_cp, n)
        fig.update(agreement=agree, agreement_own_scheme=agree_own, agreement_first_kept=agree_first)
        fig.update(datatrove=qd, ours_dt_params=qo, ours_datatrove_scheme=qc)
        fig.update(t_ours=t_ours, t_ours_datatrove_scheme=t_cp, t_datatrove=t_dt)
        print("\nwith datatrove's parameters (5-grams, 14 x 8, no threshold):")
        print(
            f"  removed: ours (near.scheme: datatrove) {len(ours_cp)}, datatrove {len(dt_removed)}, both "
            f"{len(ours_cp & dt_removed)}: agreement (Jaccard of the sets) {agree:.1%}   (bar >= 95%)"
        )
        print(
            f"  ours with its own scheme (near.scheme: snakellm): {len(ours_dt)} removed, both "
            f"{len(ours_dt & dt_removed)}: agreement {agree_own:.1%}; datatrove's clusters each keeping its first "
            f"document as ours do: {len(dt_first)} removed, agreement {agree_first:.1%}"
        )
        print(
            f"  recall at >= 0.85: ours {qo['recall_085']:.1%} (datatrove's scheme {qc['recall_085']:.1%}), "
            f"datatrove {qd['recall_085']:.1%}; removed far (< 0.7): ours {qo['removed_far']:.2%} "
            f"(datatrove's scheme {qc['removed_far']:.2%}), datatrove {qd['removed_far']:.2%}"
        )

        print(f"\nspeed, documents/s per core ({a.cores} cores; each stage's wall time x the cores it had):")
        tot_o, tot_c, tot_d = sum(t_ours.values()), sum(t_cp.values()), sum(t_dt.values())
        for who, times in (("ours", t_ours), ("ours, datatrove's scheme", t_cp), ("datatrove", t_dt)):
            for k, v in times.items():
                print(f"  {who:<25} {k:<15} {n / v / a.cores:10,.0f}")
        speed, speed_cp = tot_d / tot_o, tot_d / tot_c
        fig.update(speedup=speed, speedup_datatrove_scheme=speed_cp)
        print(
            f"  whole dedup: ours {n / tot_o / a.cores:,.0f}, datatrove {n / tot_d / a.cores:,.0f} docs/s per core: "
            f"{speed:.1f}x   (bar >= 2x)"
        )
        print(
            f"  whole dedup, ours with datatrove's scheme: {n / tot_c / a.cores:,.0f} docs/s per core: "
            f"{speed_cp:.1f}x datatrove's"
        )
        print("\nMinHash libraries (same shingle hashes, 112 values):")
        print("\n".join(bench_backends(docs[: min(n, 1500)], true_similarity(docs[: min(n, 1500)]))))
        print("\nfiltering:")
        print("\n".join(bench_filters(paths, docs, work / "chunks", work / "dt-filters", a.cores)))
        print("\nlanguage ID (resources/langid/):")
        print("\n".join(bench_langid()))
        if a.out:
            a.out.write_text(json.dumps(fig, indent=1, default=float))
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
