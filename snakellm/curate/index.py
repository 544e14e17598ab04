"""The duplicate index of a source (or of the sources sharing an index): bucket jobs, then one clustering job.

**Buckets** (``snakellm curate-buckets``, ``index_jobs`` of them): the work is split into
cells, one per (band, hash slice), with ``ceil(index_jobs / bands)`` slices a band, and job j
takes the cells c with ``c % index_jobs == j``; the exact hashes are one more band. For each
of its cells a job reads that band's rows of every signature file (memory-mapped,
band-major: only those rows are read), keeps the documents that passed the filters, sorts
their (key, document) pairs and links each document to the first one with the same key.
With ``near.threshold`` set, a near pair is kept only when the share of equal MinHash values
(the Jaccard estimate) reaches it. Memory: 32 bytes a document of one cell (cells run one at a
time): sharding a band into slices is what bounds it.

**Clustering** (``snakellm curate-index``): the connected components of all the pairs
(scipy). Each component keeps its first document in corpus order (sources in config order,
then chunks, then lines): deterministic, and the same choice as datatrove for pairs.

**datatrove's scheme** (``near.scheme: datatrove``): the bucket jobs link each document of a run
of equal band values to the one before it, the runs in the order of their values, and keep the
pairs in that order with their cell: exactly the pairs datatrove's ``MinhashDedupBuckets`` writes
(its heap pops signatures sorted by the band's values, then file, then document, and pairs each
with the previous one when equal), band after band. A band's hash slices are ranges of its first
value (as datatrove's workers per bucket are), so the cells of a band in order are the band's
order. Clustering replays the pairs in (band, slice) order through datatrove's union-find
(``MinhashDedupCluster``: union by size, a tie keeping the first document's root), and each
cluster keeps its root: datatrove's kept document, so with threshold 0 the removed set is
datatrove's (its files in our chunk order). The exact band, when on, comes after the MinHash
bands. Such pair files have a fourth column, the cell. Every
other member is removed, as ``exact_duplicate`` when its exact hash equals the kept one's,
else ``near_duplicate``, with its cluster (an id derived from the kept document's signature:
stable when other clusters come and go) and the kept document's id. Each chunk's removals
go to its own list file, rewritten only when its content changes: the curated chunk job
reads that list, so a chunk whose kept set did not change is not rebuilt (Snakemake sees
the list's old mtime after this checkpoint job).

Documents are referenced as ``file << 32 | line`` where file is the position of the chunk's
signature file in the index's input order.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from snakellm.curate import minhash
from snakellm.curate.signatures import HEADER_ROWS, exact_hashes, is_datatrove, load
from snakellm.io.atomic import atomic_path, write_json

EXACT, NEAR = 0, 1


def cells(bands: int | None, jobs: int) -> tuple[int, int]:
    """(band count including the exact band, slices per band) of an index with this many bucket jobs."""
    total = (bands or 0) + 1
    return total, max(1, math.ceil(jobs / total))


def job_cells(job: int, jobs: int, bands: int | None) -> list[tuple[int, int, int]]:
    """(band, slice, slices) triples that bucket job ``job`` of ``jobs`` handles; band == bands is exact."""
    total, slices = cells(bands, jobs)
    return [(c // slices, c % slices, slices) for c in range(total * slices) if c % jobs == job]


def memory_per_job(documents: int, bands: int | None, jobs: int, datatrove_rows: int = 0) -> int:
    """Bytes a bucket job holds at most: its cells run one at a time, each 16 bytes (key + reference) per
    document of its slice, twice while sorting; plus one byte per document for the filter verdicts. In
    datatrove's scheme (``datatrove_rows``: the band's rows) a document's key is its ``rows`` 64-bit values."""
    _, slices = cells(bands, jobs)
    per_doc = 8 * (datatrove_rows + 1) if datatrove_rows else 16
    return int(documents / slices * per_doc * 2 + documents)


def _band_keys(sig: np.ndarray, band: int, bands: int | None, rows: int) -> np.ndarray:
    if bands is None or band == bands:
        return exact_hashes(sig)
    vals = np.asarray(sig[HEADER_ROWS + band * rows : HEADER_ROWS + (band + 1) * rows]).T
    empty = np.asarray(~vals.any(axis=1))
    return minhash.band_keys(vals, 1, rows, empty)[0]


def _band_values(sig: np.ndarray, band: int, rows: int) -> np.ndarray:
    """[documents, rows] uint64 values of a band in datatrove's scheme (two uint32 rows a value)."""
    lo = HEADER_ROWS + 2 * band * rows
    return np.ascontiguousarray(np.asarray(sig[lo : lo + 2 * rows]).T).view(np.uint64)


def _ordered_buckets(
    sigs: Sequence[np.ndarray], passed: Sequence[np.ndarray], job: int, jobs: int, exact: bool, near: dict[str, Any]
) -> tuple[np.ndarray, dict[str, int]]:
    """datatrove's scheme: each cell's pairs in datatrove's order, (previous, current) of each run of equal values."""
    bands, rows = near["bands"], near["rows"]
    threshold = float(near.get("threshold") or 0)
    found: list[np.ndarray] = []
    counts = {"candidates": 0, "pairs": 0, "rejected_by_threshold": 0}
    for band, sl, slices in job_cells(job, jobs, bands):
        is_exact = band == bands
        if is_exact and not exact:
            continue
        cols: list[list[np.ndarray]] = [[] for _ in range(1 if is_exact else rows)]
        refs = []
        for fi, (sig, ok) in enumerate(zip(sigs, passed)):
            if is_exact:
                v = exact_hashes(sig).reshape(-1, 1)
                sel = ok & (v[:, 0] != 0)
                part = v[:, 0] % np.uint64(slices)
            else:
                v = _band_values(sig, band, rows)
                sel = ok & v.any(axis=1)  # all zero: no shingles, no signature
                part = v[:, 0] // np.uint64(-(-int(minhash.DT_PRIME) // slices))  # ranges of the first value
            if slices > 1:
                sel &= part == sl
            idx = np.flatnonzero(sel)
            for k in range(v.shape[1]):
                cols[k].append(v[idx, k])
            refs.append((np.uint64(fi) << np.uint64(32)) | idx.astype(np.uint64))
        if not refs:
            continue
        ref = np.concatenate(refs)
        vals = [np.concatenate(c) for c in cols]
        order = np.lexsort((ref, *reversed(vals)))  # by the values (the first most significant), then document
        ref = ref[order]
        same = np.ones(max(0, len(ref) - 1), dtype=bool)
        for c in vals:
            c = c[order]
            same &= c[1:] == c[:-1]
        a, b = ref[:-1][same], ref[1:][same]
        counts["candidates"] += len(a)
        if not is_exact and threshold > 0:
            keep = estimate(sigs, a, b, wide=True) >= threshold
            counts["rejected_by_threshold"] += int((~keep).sum())
            a, b = a[keep], b[keep]
        cell = np.uint64(band * slices + sl)
        kind = EXACT if is_exact else NEAR
        found.append(np.stack([a, b, np.full(len(a), kind, np.uint64), np.full(len(a), cell, np.uint64)], axis=1))
    pairs = np.concatenate(found) if found else np.zeros((0, 4), dtype=np.uint64)
    counts["pairs"] = len(pairs)
    return pairs, counts


def buckets(
    sig_files: Sequence[str],
    out: str,
    *,
    job: int,
    jobs: int,
    exact: bool,
    near: dict[str, Any] | None,
) -> dict[str, int]:
    """Write bucket job ``job``'s pairs to ``out`` (uint64 [pairs, 3]: kept-side ref, other ref, kind; in
    datatrove's scheme [pairs, 4]: previous ref, ref, kind, cell, in datatrove's order)."""
    sigs = [load(f) for f in sig_files]
    passed = [np.asarray(s[0]) == 0 for s in sigs]
    if is_datatrove(near):
        assert near is not None
        pairs, counts = _ordered_buckets(sigs, passed, job, jobs, exact, near)
    else:
        pairs, counts = _keyed_buckets(sigs, passed, job, jobs, exact, near)
    with atomic_path(out) as tmp:
        with open(tmp, "wb") as fh:
            np.save(fh, pairs)
    return counts


def _keyed_buckets(
    sigs: Sequence[np.ndarray],
    passed: Sequence[np.ndarray],
    job: int,
    jobs: int,
    exact: bool,
    near: dict[str, Any] | None,
) -> tuple[np.ndarray, dict[str, int]]:
    """Our scheme: each cell's pairs, every member of a run of equal band keys linked to the run's first."""
    bands, rows = (near["bands"], near["rows"]) if near else (None, 0)
    found: list[np.ndarray] = []
    counts = {"candidates": 0, "pairs": 0, "rejected_by_threshold": 0}
    for band, sl, slices in job_cells(job, jobs, bands):
        is_exact = bands is None or band == bands
        if is_exact and not exact:
            continue
        keys, refs = [], []
        for fi, (sig, ok) in enumerate(zip(sigs, passed)):
            k = _band_keys(sig, band, bands, rows)
            sel = ok & (k != 0)
            if slices > 1:
                sel &= (k % np.uint64(slices)) == sl
            idx = np.flatnonzero(sel)
            keys.append(k[idx])
            refs.append((np.uint64(fi) << np.uint64(32)) | idx.astype(np.uint64))
        if not keys:
            continue
        key, ref = np.concatenate(keys), np.concatenate(refs)
        order = np.lexsort((ref, key))
        key, ref = key[order], ref[order]
        same = np.flatnonzero(key[1:] == key[:-1]) + 1  # positions equal to their predecessor
        if not len(same):
            continue
        # each run of equal keys links every member to the run's first (smallest ref)
        starts = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
        first = ref[starts[np.searchsorted(starts, same, side="right") - 1]]
        a, b = first, ref[same]
        counts["candidates"] += len(a)
        kind = EXACT if is_exact else NEAR
        if not is_exact and near is not None and float(near.get("threshold") or 0) > 0:
            sim = estimate(sigs, a, b)
            keep = sim >= float(near["threshold"])
            counts["rejected_by_threshold"] += int((~keep).sum())
            a, b = a[keep], b[keep]
        found.append(np.stack([a, b, np.full(len(a), kind, dtype=np.uint64)], axis=1))
    pairs = np.concatenate(found) if found else np.zeros((0, 3), dtype=np.uint64)
    if len(pairs):
        pairs = np.unique(pairs, axis=0)
    counts["pairs"] = len(pairs)
    return pairs, counts


def _gather(sigs: Sequence[np.ndarray], refs: np.ndarray, rows: slice) -> np.ndarray:
    """[len(refs), rows] values of the referenced documents (grouped by file: one fancy index per file)."""
    files, docs = (refs >> np.uint64(32)).astype(np.int64), (refs & np.uint64(0xFFFFFFFF)).astype(np.int64)
    out: np.ndarray | None = None
    for fi in np.unique(files):
        sel = np.flatnonzero(files == fi)
        block = np.asarray(sigs[fi][rows][:, docs[sel]]).T
        if out is None:
            out = np.zeros((len(refs), block.shape[1]), dtype=block.dtype)
        out[sel] = block
    return out if out is not None else np.zeros((0, 0), dtype=np.uint32)


def estimate(sigs: Sequence[np.ndarray], a: np.ndarray, b: np.ndarray, wide: bool = False) -> np.ndarray:
    """MinHash Jaccard estimates of the pairs (a[i], b[i]): the share of equal values (``wide``: 64-bit values,
    datatrove's scheme)."""
    if not len(a):
        return np.zeros(0)
    rows = slice(HEADER_ROWS, None)
    va, vb = _gather(sigs, a, rows), _gather(sigs, b, rows)
    if wide:
        va, vb = np.ascontiguousarray(va).view(np.uint64), np.ascontiguousarray(vb).view(np.uint64)
    return (va == vb).mean(axis=1)


def union_by_size(pairs: np.ndarray, n: int) -> np.ndarray:
    """Each node's root after ``union(a, b)`` of every pair in order, as datatrove's ``MinhashDedupCluster``
    unites them: the smaller set joins the larger, and on equal sizes b's set joins a's."""
    parent = list(range(n))
    size = [1] * n

    def find(x: int) -> int:
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    for a, b in pairs.tolist():
        ra, rb = find(a), find(b)
        if ra != rb:
            if size[ra] < size[rb]:
                ra, rb = rb, ra
            parent[rb] = ra
            size[ra] += size[rb]
    return np.array([find(x) for x in range(n)], dtype=np.int64)


def cluster_hashes(sigs: Sequence[np.ndarray], kept: np.ndarray) -> np.ndarray:
    """Each kept document's cluster id (printed as 16 hex digits): a hash of its signature column (exact hash and
    MinHash values), so that an id depends on the kept document's text alone and a change elsewhere renumbers
    nothing."""
    import xxhash

    cols = _gather(sigs, kept, slice(1, None))
    return np.fromiter((xxhash.xxh3_64_intdigest(c.tobytes()) for c in cols), dtype=np.uint64, count=len(kept))


def doc_id(names: Sequence[tuple[str, str]], ref: int) -> str:
    source, chunk = names[ref >> 32]
    return f"{source}/{chunk}:{ref & 0xFFFFFFFF}"


def cluster(
    sig_files: Sequence[str],
    names: Sequence[tuple[str, str]],
    pair_files: Sequence[str],
    lists: Sequence[str],
    summary_path: str,
) -> dict[str, Any]:
    """Cluster the pairs; write each chunk's removal list (only where it changed) and the index summary."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    pairs = [np.load(f) for f in pair_files]
    widths = {p.shape[1] for p in pairs}
    if len(widths) > 1:
        raise ValueError(
            f"pair files of different schemes ({', '.join(f'{f}: {p.shape[1]} columns' for f, p in zip(pair_files, pairs))}"
            "): their bucket jobs ran with different near.scheme settings"
        )
    ordered = widths == {4}  # datatrove's scheme
    allp = np.concatenate(pairs) if pairs else np.zeros((0, 3), dtype=np.uint64)
    del pairs
    n_pairs = len(allp)
    clusters = 0
    rem_nodes = rem_kept = np.zeros(0, dtype=np.uint64)
    is_exact = np.zeros(0, dtype=bool)
    cluster_of = np.zeros(0, dtype=np.uint64)
    if len(allp):
        if ordered:  # datatrove's pair order: band after band (each job's cells are in order already)
            allp = allp[np.argsort(allp[:, 3], kind="stable")]
        nodes, inv = np.unique(allp[:, :2], return_inverse=True)
        inv = inv.reshape(-1, 2)
        del allp
        if ordered:
            root = union_by_size(inv, len(nodes))
            clusters = len(np.unique(root))
            kept_of = nodes[root]  # datatrove's kept document: its union-find root
            del root
        else:
            graph = coo_matrix((np.ones(len(inv), dtype=np.int8), (inv[:, 0], inv[:, 1])), shape=(len(nodes),) * 2)
            clusters, labels = connected_components(graph, directed=False)
            del graph
            kept = np.full(clusters, np.iinfo(np.uint64).max, dtype=np.uint64)
            np.minimum.at(kept, labels, nodes)  # the first document in corpus order
            kept_of = kept[labels]
            del labels, kept
        del inv
        removed = nodes != kept_of
        rem_nodes, rem_kept = nodes[removed], kept_of[removed]  # sorted by node: grouped by file
        del nodes, kept_of, removed
        sigs = [load(f) for f in sig_files]
        own, theirs = _gather(sigs, rem_nodes, slice(1, 3)), _gather(sigs, rem_kept, slice(1, 3))
        is_exact = (own == theirs).all(axis=1) & (own != 0).any(axis=1)
        uniq, which = np.unique(rem_kept, return_inverse=True)
        cluster_of = cluster_hashes(sigs, uniq)[which.ravel()]
    by_reason = {"exact_duplicate": int(is_exact.sum()), "near_duplicate": int((~is_exact).sum())}
    files = (rem_nodes >> np.uint64(32)).astype(np.int64)
    bounds = np.searchsorted(files, np.arange(len(sig_files) + 1))
    rewritten = 0
    for fi, lst in enumerate(lists):
        a, b = bounds[fi], bounds[fi + 1]
        rows = [
            [node & 0xFFFFFFFF, "exact_duplicate" if ex else "near_duplicate", f"{c:016x}", doc_id(names, k)]
            for node, k, c, ex in zip(
                rem_nodes[a:b].tolist(), rem_kept[a:b].tolist(), cluster_of[a:b].tolist(), is_exact[a:b].tolist()
            )
        ]
        rewritten += write_if_changed(lst, {"removed": rows})
    documents = sum(int(load(f).shape[1]) for f in sig_files)
    summary = {
        "documents": documents,
        "chunks": len(sig_files),
        "pairs": int(n_pairs),
        "clusters": int(clusters),
        "removed": sum(by_reason.values()),
        "removed_by_reason": by_reason,
        "lists_rewritten": rewritten,
    }
    write_json(summary_path, summary)
    return summary


def read_plan(path: str) -> list[tuple[str, str, str]]:
    """An index's chunk list (data/plan/curate-index/{index}.tsv): (source/chunk, signatures, removal list)."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 3 or "/" not in parts[0]:
                raise ValueError(f"{path} line {lineno}: expected source/chunk, signatures and list, tab-separated")
            out.append((parts[0], parts[1], parts[2]))
    return out


def write_if_changed(path: str, obj: Any) -> int:
    """Write ``obj`` as JSON to ``path`` atomically unless the file already holds exactly that (mtime kept)."""
    text = json.dumps(obj, separators=(",", ":")) + "\n"
    try:
        with open(path, encoding="utf-8") as fh:
            if fh.read() == text:
                return 0
    except FileNotFoundError:
        pass
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return 1


def read_list(path: str) -> dict[int, tuple[str, str, str]]:
    """A removal list: line -> (reason, cluster id, kept id)."""
    with open(path, encoding="utf-8") as fh:
        return {int(r[0]): (r[1], str(r[2]), r[3]) for r in json.load(fh)["removed"]}


def stale_lists(lists: Sequence[str]) -> list[str]:
    """The lists that are missing (deleted by hand): their index must run again."""
    return [p for p in lists if not os.path.exists(p)]
