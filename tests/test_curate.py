"""Curation's parts, in process (milliseconds to seconds): normalisation, shingles and MinHash, the filters
(datatrove's, with datatrove's parameters), language ID, the index's buckets and clusters, the curated chunk,
the settings' flags. The end-to-end incremental run is tests/test_curate_workflow.py."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shlex

import numpy as np
import pytest
from tokenize_helpers import corpus

from snakellm.config import checks, flags, sections
from snakellm.config.validate import ConfigError
from snakellm.curate import apply, filters, index, minhash, signatures
from snakellm.steps import curate_buckets, curate_signatures

TEXTS = [t for docs in corpus().values() for t in docs]


def test_simplify_is_datatrove_simplify_text():
    from datatrove.utils.text import simplify_text

    odd = ["Ça  va? Très   bien—merci!\n\t123,45 €", "naïve café ΑΘΗΝΑ 12.5%", "a \u0301 b", "", "  ...  "]
    odd += ["x\x1cy\x1fz 1.2.3 ,5 5, a\x0bb\x0cc", "A1,000.50 and 3.14, 2,5"]
    for t in TEXTS + odd:
        assert minhash.simplify(t) == simplify_text(t)


def test_shingles_stay_inside_a_text_and_short_texts_are_one_shingle():
    grams, off = minhash.shingle_hashes(["a b c d e f", "", "a b", "c d e f g"], 5)
    assert list(np.diff(off)) == [2, 0, 1, 1]
    # the same words give the same shingle wherever they are; a window never spans two texts
    g2, _ = minhash.shingle_hashes(["x y", "c d e f g"], 5)
    assert grams[off[3]] == g2[1]
    assert grams[off[0] + 1] != grams[off[3]]  # "b c d e f" is not "c d e f g"
    with pytest.raises(ValueError, match="ngram"):
        minhash.shingle_hashes(["a"], 0)


def _jaccard(a: str, b: str, n: int = 5) -> float:
    def grams(t):
        w = minhash.simplify(t).split()
        return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}

    x, y = grams(a), grams(b)
    return len(x & y) / len(x | y)


@pytest.mark.parametrize("backend", minhash.BACKENDS)
def test_minhash_estimates_the_jaccard_similarity(backend):
    base = TEXTS[0]
    words = base.split(" ")
    edited = " ".join("edited" if i % 40 == 0 else w for i, w in enumerate(words))
    other = TEXTS[5]
    grams, off = minhash.shingle_hashes([minhash.simplify(t) for t in (base, edited, other)], 5)
    fn = getattr(minhash, f"minhash_{backend}")
    v = fn(grams, off, 256, 1)
    est = [(v[0] == v[1]).mean(), (v[0] == v[2]).mean()]
    true = [_jaccard(base, edited), _jaccard(base, other)]
    assert abs(est[0] - true[0]) < 0.1 and est[1] < 0.05, (backend, est, true)


def test_band_keys_match_exactly_when_a_band_does():
    v = np.array([[1, 2, 3, 4], [1, 2, 9, 9], [0, 0, 0, 0]], dtype=np.uint32)
    keys = minhash.band_keys(v, 2, 2, np.array([False, False, True]))
    assert keys.shape == (2, 3)
    assert keys[0, 0] == keys[0, 1] and keys[1, 0] != keys[1, 1]
    assert (keys[:, 2] == 0).all() and (keys[:, :2] != 0).all()
    assert minhash.lsh_probability(0.85, 14, 8) > 0.98 and minhash.lsh_probability(0.3, 14, 8) < 0.001


@pytest.mark.parametrize(
    "name, cls",
    [
        ("GopherQualityFilter", sections.GopherQualitySettings),
        ("GopherRepetitionFilter", sections.GopherRepetitionSettings),
        ("C4QualityFilter", sections.C4Settings),
        ("FineWebQualityFilter", sections.FineWebSettings),
    ],
)
def test_filter_settings_are_datatrove_parameters_with_its_defaults(name, cls):
    import datatrove.pipeline.filters as dt

    params = inspect.signature(getattr(dt, name).__init__).parameters
    ours = {f.name: getattr(cls(), f.name) for f in dataclasses.fields(cls)}
    theirs = {k: p.default for k, p in params.items() if k not in ("self", "exclusion_writer", "language")}
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        want = [list(x) for x in v] if isinstance(v, tuple) else v
        assert ours[k] == want, k


def test_each_filter_names_the_rule_a_document_fails():
    def one(name, text, **settings):
        return filters.build({"filters": {name: settings}}).verdict(text)[0]

    assert one("gopher_quality", "too short") == "gopher_quality:gopher_short_doc"
    assert one("gopher_quality", "too short", min_doc_words=1, min_stop_words=0) is None  # a setting counts
    assert (
        one("gopher_repetition", "\n".join(["the same line again and again"] * 20)) == "gopher_repetition:dup_line_frac"
    )
    assert one("c4", TEXTS[70] + "\nLorem ipsum dolor sit amet, consectetur.") == "c4:lorem_ipsum"
    assert one("fineweb", "\n".join(f"a line without an end {i}" for i in range(20))) == "fineweb:line_punct_ratio"
    with pytest.raises(ValueError, match="gopher_quality: unknown setting"):
        filters.build({"filters": {"gopher_quality": {"min_words": 3}}})


@pytest.mark.slow  # datatrove's filters: ~2 s; the fast tier's 90 s has no room
def test_the_judge_gives_datatrove_filters_own_verdicts():
    from datatrove.data import Document

    judge = filters.build({"filters": {n: {} for n in sections.CURATE_FILTERS}})
    botchan = corpus()["botchan"]
    for text in botchan:
        want = None
        for name, f in judge.filters:
            ok = f.filter(Document(text=text, id=""))
            if ok is not True:
                want = f"{name}:{ok[1]}"
                break
        assert judge.verdict(text)[0] == want
    assert sum(judge.verdict(t)[0] is None for t in botchan) >= 40


@pytest.mark.parametrize("model", sections.LANGUAGE_MODELS)
def test_language_id_ships_its_model_and_rejects_other_languages(model):
    judge = filters.build({"languages": ["en"], "language_model": model, "language_threshold": 0.5})
    assert judge.verdict(TEXTS[0])[:2] == (None, "en")
    fr = "Le chat est assis sur le tapis et il regarde la pluie tomber doucement sur les toits de la ville."
    rule, lang, score = judge.verdict(fr)
    assert (rule, lang) == ("language_id", "fr") and 0 < score <= 1


def _chunk(tmp_path, name, texts):
    p = tmp_path / f"{name}.jsonl"
    p.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(p)


def test_index_keeps_the_first_of_each_cluster_and_rewrites_only_changed_lists(tmp_path):
    a, b, c = TEXTS[0], TEXTS[1], TEXTS[2]
    near_a = a.replace(" the ", " a ", 3)
    chunks = {"c0": [a, b, "Short one."], "c1": [near_a, c, b], "c2": [TEXTS[3]]}
    cur = {"exact": True, "near": {"threshold": 0.8, "ngram": 5, "bands": 14, "rows": 8, "seed": 1}}
    sigs = []
    for name, texts in chunks.items():
        npy = str(tmp_path / f"{name}.npy")
        signatures.compute(_chunk(tmp_path, name, texts), npy, npy[:-4] + ".json", cur, show_progress=False)
        sigs.append(npy)
    names = [("s", n) for n in chunks]
    lists = [str(tmp_path / f"{n}.list.json") for n in chunks]

    def run(jobs):
        pairs = []
        for j in range(jobs):
            out = str(tmp_path / f"pairs-{j}-of-{jobs}.npy")
            index.buckets(sigs, out, job=j, jobs=jobs, exact=True, near=cur["near"])
            pairs.append(out)
        return index.cluster(sigs, names, pairs, lists, str(tmp_path / "index.json"))

    s = run(1)
    assert s["removed_by_reason"] == {"exact_duplicate": 1, "near_duplicate": 1} and s["clusters"] == 2
    got = index.read_list(lists[1])
    assert {i: (r, k) for i, (r, _, k) in got.items()} == {
        0: ("near_duplicate", "s/c0:0"),
        2: ("exact_duplicate", "s/c0:1"),
    }
    assert got[0][1] != got[2][1] and all(len(c) == 16 for _, c, _ in got.values())  # one id per cluster
    assert index.read_list(lists[0]) == {} and index.read_list(lists[2]) == {}
    # sharding the bands over 5 jobs (15 cells: 14 bands + exact) finds the same
    mtimes = [os.stat(p).st_mtime_ns for p in lists]
    s5 = run(5)
    assert s5["removed"] == 2 and s5["lists_rewritten"] == 0
    assert [os.stat(p).st_mtime_ns for p in lists] == mtimes
    assert index.job_cells(0, 5, 14) == [(0, 0, 1), (5, 0, 1), (10, 0, 1)]
    assert len({c for j in range(40) for c in index.job_cells(j, 40, 14)}) == 15 * 3
    # SlimPajama's 590M documents: 90 bucket jobs (6 slices a band) hold under 4 GiB each
    assert index.memory_per_job(590_000_000, 14, 90) < 4 * 1024**3 < index.memory_per_job(590_000_000, 14, 15)

    # the curated chunk: kept lines byte for byte, the removed with reason, cluster and kept id
    out, rem, st = (str(tmp_path / f"cur{e}") for e in (".jsonl", ".removed.jsonl", ".stats.json"))
    src = str(tmp_path / "c1.jsonl")
    stats = apply.curate_chunk(src, sigs[1], sigs[1][:-4] + ".json", lists[1], out, rem, st, source="s", chunk="c1")
    assert open(out, "rb").read() == open(src, "rb").readlines()[1]
    removed = [json.loads(x) for x in open(rem)]
    assert [(r["line"], r["reason"], r["kept"]) for r in removed] == [
        (1, "near_duplicate", "s/c0:0"),
        (3, "exact_duplicate", "s/c0:1"),
    ]
    assert json.loads(removed[1]["content"])["text"] == b
    assert stats["documents"] == 1 and stats["removed_by_reason"] == {"exact_duplicate": 1, "near_duplicate": 1}


def test_threshold_zero_keeps_every_candidate_and_exact_off_keeps_copies(tmp_path):
    cur = {"exact": False, "near": None}
    npy = str(tmp_path / "c.npy")
    signatures.compute(_chunk(tmp_path, "c", [TEXTS[0], TEXTS[0]]), npy, npy[:-4] + ".json", cur, show_progress=False)
    out = str(tmp_path / "p.npy")
    assert index.buckets([npy], out, job=0, jobs=1, exact=False, near=None)["pairs"] == 0


def test_rule_flags_parse_back_to_the_same_settings():
    cur = {
        "exact": True,
        "near": {
            "threshold": 0.7,
            "ngram": 3,
            "bands": 20,
            "rows": 13,
            "seed": 2,
            "scheme": "datatrove",
            "index_jobs": 4,
        },
        "filters": {"gopher_quality": {"min_doc_words": 10}, "c4": {}},
        "languages": ["en", "de"],
        "language_threshold": 0.6,
        "language_model": "pycld2",
        "index": None,
    }
    p = curate_signatures.build_parser()
    a = p.parse_args(["x.jsonl", "--output", "o", "--summary", "s", *shlex.split(flags.curate_flags(cur))])
    from snakellm.curate import settings as cs

    got = cs.from_args(a, p)
    assert got["near"] == {**cur["near"], "index_jobs": 1}
    assert got["filters"] == {"gopher_quality": {"min_doc_words": 10}, "c4": {}}
    assert (got["languages"], got["language_threshold"], got["exact"]) == (["en", "de"], 0.6, True)
    pb = curate_buckets.build_parser()
    b = pb.parse_args(["s.npy", "--output", "o", *shlex.split(flags.curate_flags(cur, filters=False))])
    assert cs.from_args(b, pb)["near"]["bands"] == 20 and cs.from_args(b, pb)["near"]["scheme"] == "datatrove"
    with pytest.raises(SystemExit):
        p.parse_args(["x", "--output", "o", "--summary", "s", "--filter", "c4", "--filter-setting", "c4.nope=1"])
        cs.from_args(p.parse_args(["x", "--output", "o", "--summary", "s", "--filter-setting", "c4.nope=1"]), p)


def test_sources_sharing_an_index_must_hash_alike():
    near = {"threshold": 0.8}
    cfg = {
        "sources": {
            "a": {"curate": {"exact": True, "near": near, "index": "web"}},
            "b": {"curate": {"exact": True, "near": {"threshold": 0.7}, "index": "web"}},
            "c": {},
        }
    }
    assert checks.curate_indexes(cfg) == {"web": ["a", "b"]}
    with pytest.raises(ConfigError, match="sources.b.curate.near: sources sharing the index 'web'"):
        checks.check_curate(cfg)
    cfg["sources"]["b"]["curate"]["near"] = near
    checks.check_curate(cfg)
    cfg["sources"]["a"]["curate"]["index"] = "c"
    with pytest.raises(ConfigError, match="'c' is the name of another source"):
        checks.check_curate(cfg)


@pytest.mark.slow  # 1.1 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
def test_an_empty_curated_chunk_is_an_empty_dataset_the_blend_leaves_out(tmp_path):
    from conftest import REPO

    from snakellm.steps import tokenize as tokstep
    from snakellm.tokenize.blend import BlendError, build_blend

    tok = ["--kind", "gpt2-bpe", "--vocab-file", str(REPO / "resources/tokenizers/gpt2/vocab.json")]
    tok += ["--merges-file", str(REPO / "resources/tokenizers/gpt2/merges.txt"), "--no-progress", "--threads", "1"]
    (tmp_path / "e.jsonl").write_text("")
    (tmp_path / "f.jsonl").write_text(json.dumps({"text": "Hello world"}) + "\n")
    assert tokstep.main([str(tmp_path / "e.jsonl"), str(tmp_path / "e"), "--source", "s", *tok]) == 1  # an error...
    assert tokstep.main([str(tmp_path / "e.jsonl"), str(tmp_path / "e"), "--source", "s", "--allow-empty", *tok]) == 0
    assert tokstep.main([str(tmp_path / "f.jsonl"), str(tmp_path / "f"), "--source", "s", *tok]) == 0
    blend = build_blend([str(tmp_path / "e.stats.json"), str(tmp_path / "f.stats.json")], {"s": 1.0})
    assert blend["data_prefix"] == [1.0, str(tmp_path / "f")] and blend["documents"] == 1
    with pytest.raises(BlendError, match="no documents in any"):
        build_blend([str(tmp_path / "e.stats.json")], {"s": 1.0})


def test_adding_or_removing_a_chunk_leaves_the_other_lists_as_they_were(tmp_path):
    cur = {"exact": True, "near": {"threshold": 0.8, "ngram": 5, "bands": 14, "rows": 8, "seed": 1}}
    chunks = {"c0": [TEXTS[0], TEXTS[1]], "c1": [TEXTS[2], TEXTS[1]], "c2": [TEXTS[3]], "c3": [TEXTS[4], TEXTS[2]]}
    for name, texts in chunks.items():
        npy = str(tmp_path / f"{name}.npy")
        signatures.compute(_chunk(tmp_path, name, texts), npy, npy[:-4] + ".json", cur, show_progress=False)

    def run(names):
        sigs = [str(tmp_path / f"{n}.npy") for n in names]
        out = str(tmp_path / f"pairs-{'-'.join(names)}.npy")
        index.buckets(sigs, out, job=0, jobs=1, exact=True, near=cur["near"])
        lists = [str(tmp_path / f"{n}.list.json") for n in names]
        index.cluster(sigs, [("s", n) for n in names], [out], lists, str(tmp_path / "index.json"))
        return {n: (os.stat(p).st_mtime_ns, index.read_list(p)) for n, p in zip(names, lists)}

    first = run(["c0", "c1", "c2"])
    assert first["c1"][1][1][2] == "s/c0:1" and first["c2"][1] == {}
    added = run(["c0", "c1", "c2", "c3"])  # a new chunk: a copy of c1's first document
    assert {n: added[n] for n in first} == first  # every other list untouched, mtime included
    (line, (reason, cluster, kept)), *rest = added["c3"][1].items()
    assert (line, reason, kept, len(cluster), rest) == (1, "exact_duplicate", "s/c1:0", 16, [])
    removed = run(["c0", "c1", "c3"])  # c2 leaves the index
    assert removed["c0"] == first["c0"] and removed["c1"] == first["c1"] and removed["c3"] == added["c3"]
