"""``near.scheme: datatrove``: our curation computes datatrove 0.10's MinHash signatures value for value and
removes exactly the documents datatrove's own MinHash dedup removes (its four pipeline stages run by its
LocalPipelineExecutor on the same chunks), with the index's bands sharded or not."""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest
from tokenize_helpers import corpus

from snakellm.curate import index, minhash, signatures
from snakellm.curate.filters import split_tokenizer

TEXTS = [t for docs in corpus().values() for t in docs]
NEAR = {"threshold": 0.0, "ngram": 5, "bands": 14, "rows": 8, "seed": 1}  # datatrove's MinhashConfig defaults


@pytest.fixture
def dt_hash(monkeypatch):
    """datatrove 0.10 hashes its shingles as str, which xxhash < 4 encodes as UTF-8 (its `processing` extra pins
    it); xxhash 4 (installed) takes bytes only: the same function, given the UTF-8 bytes."""
    import datatrove.utils.hashes.xxhash as dx
    import xxhash

    monkeypatch.setattr(dx, "xxhash64", lambda d: xxhash.xxh64_intdigest(d.encode() if isinstance(d, str) else d))


def test_datatrove_scheme_signatures_are_datatrove_signatures(dt_hash, tmp_path):
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature

    step = MinhashDedupSignature(str(tmp_path / "unused"), config=MinhashConfig(), language=split_tokenizer())
    odd = ["Ça  va? Très   bien—merci!\n\t123,45 € and more words", "a \u0301 b c d e f", "four words only here", ""]
    odd += ["x\x1cy\x1fz 1.2.3 ,5 5, a\x0bb\x0cc A1,000.50 and 3.14, 2,5 (ASCII: the bytes path)", "٣٫٥ ١٢ naïve ΑΘΗΝΑ"]
    texts = TEXTS[:30] + odd
    grams, off = minhash.datatrove_shingles(texts, 5)
    values = minhash.datatrove_signatures(grams, off, 14 * 8, 1)
    for i, t in enumerate(texts):
        shingles = step.get_shingles(t)
        assert np.array_equal(shingles.ravel(), grams[off[i] : off[i + 1]]), i
        if shingles.size:
            assert np.array_equal(np.array(step.get_signature(shingles), dtype=np.uint64).ravel(), values[i]), i
        else:  # fewer than 5 words: no signature, as datatrove writes none
            assert not values[i].any() and i >= 30


def _planted(rng: random.Random) -> list[str]:
    """Pieces of ~120 words of the shipped corpus, and families of near duplicates: each member an edit of a few
    words of an earlier one, so that clusters of 3-5 chain through different bands."""
    words = " ".join(TEXTS).split(" ")
    pieces = [" ".join(words[i : i + 120]) for i in range(0, 120 * 90, 120)]
    docs = []
    for p in pieces:
        family = [p]
        for _ in range(rng.choice([0, 0, 1, 2, 3, 4])):
            w = rng.choice(family).split(" ")
            for j in rng.sample(range(len(w)), 3):
                w[j] = rng.choice(["edited", "changed", "x"])
            family.append(" ".join(w))
        docs += family
    rng.shuffle(docs)
    return docs


def _datatrove_removed(chunks: str, work: str, files: int) -> tuple[set[tuple[int, int]], dict[tuple[int, int], int]]:
    """datatrove's MinHash dedup (stages 1-3) on the chunk files: its removed (file, line)s and every clustered
    document's cluster id."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupSignature
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.readers import JsonlReader

    cfg = MinhashConfig()
    stages = [
        (
            [
                JsonlReader(chunks, glob_pattern="*.jsonl", compression=None),
                MinhashDedupSignature(f"{work}/sigs", config=cfg, language=split_tokenizer()),
            ],
            files,
        ),
        ([MinhashDedupBuckets(f"{work}/sigs", f"{work}/buckets", config=cfg)], cfg.num_buckets),
        ([MinhashDedupCluster(f"{work}/buckets", f"{work}/remove", config=cfg, save_cluster_id=True)], 1),
    ]
    for i, (pipeline, tasks) in enumerate(stages):
        LocalPipelineExecutor(pipeline, tasks=tasks, workers=1, logging_dir=f"{work}/logs/{i}").run()
    removed, cluster = set(), {}
    for f in range(files):
        with open(f"{work}/remove/{f:06d}.remove", "rb") as fh:
            removed |= {(f, d) for (d,) in struct.iter_unpack("<I", fh.read())}
        with open(f"{work}/remove/{f:06d}.clusters", "rb") as fh:
            cluster.update({(f, d): c for d, c in struct.iter_unpack("<2I", fh.read())})
    return removed, cluster


@pytest.mark.slow  # 1.6 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
def test_datatrove_scheme_removes_what_datatrove_minhash_dedup_removes(dt_hash, tmp_path):
    docs = _planted(random.Random(0))
    (tmp_path / "chunks").mkdir()
    per = -(-len(docs) // 3)
    paths = []
    for c in range(3):
        paths.append(tmp_path / "chunks" / f"chunk-{c}.jsonl")
        paths[-1].write_text(
            "".join(
                json.dumps({"id": str(i), "text": docs[i]}) + "\n"
                for i in range(c * per, min(len(docs), (c + 1) * per))
            )
        )
    theirs, their_cluster = _datatrove_removed(str(tmp_path / "chunks"), str(tmp_path / "dt"), 3)
    assert len(theirs) > 40 and max(list(their_cluster.values()).count(c) for c in their_cluster.values()) >= 4

    def ours(scheme: str, jobs: int) -> dict[tuple[int, int], tuple[int, int]]:
        cur = {"exact": False, "near": {**NEAR, "scheme": scheme}}
        sigs, lists = [], []
        for c, p in enumerate(paths):
            npy = str(tmp_path / f"{scheme}-{c}.npy")
            signatures.compute(str(p), npy, npy[:-4] + ".json", cur, show_progress=False)
            sigs.append(npy)
            lists.append(str(tmp_path / f"{scheme}-{jobs}-{c}.list.json"))
        pairs = [str(tmp_path / f"{scheme}-pairs-{j}-of-{jobs}.npy") for j in range(jobs)]
        for j, out in enumerate(pairs):
            index.buckets(sigs, out, job=j, jobs=jobs, exact=False, near=cur["near"])
        index.cluster(sigs, [("s", f"chunk-{c}") for c in range(3)], pairs, lists, str(tmp_path / "index.json"))
        got = {}
        for c, lst in enumerate(lists):
            for line, (_, _, kept) in index.read_list(lst).items():
                kc, kl = kept.removeprefix("s/chunk-").split(":")
                got[(c, line)] = (int(kc), int(kl))
        return got

    for jobs in (1, 30):  # 30 jobs: each of the 14 bands (and the exact band) in 2 hash slices, one job each
        got = ours("datatrove", jobs)
        assert set(got) == theirs, jobs
        # each removed document's kept one is in its datatrove cluster, and datatrove keeps it
        assert all(their_cluster[d] == their_cluster[k] and k not in theirs for d, k in got.items())
    # our own scheme (other signatures, each cluster keeping its first document) removes another set
    own = set(ours("snakellm", 1))
    assert own != theirs and len(own & theirs) < 0.9 * len(theirs)
