"""Reports and DAG pictures.

* the data, tokens, train and table steps on real step outputs (a chunk with bad lines
  made by the real `snakellm chunk`), checked for the figures a reader should see;
* the job DAG of a 60,000-shard source collapses to a readable picture;
* the report of the default workflow (`snakemake --report`), opened in headless Chromium
  like a person would: categories, every plot decodes as an image, tables hold the
  workflow's real figures, clicking through shows them; screenshots are kept under
  test-artifacts/report/ (or $SNAKELLM_ARTIFACTS/report/) and the path is printed.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from chromium import find_chromium
from conftest import BIN, REPO, SNAKEFILE, Workspace, env_with_venv

pytestmark = []
NEEDS_CHROMIUM = pytest.mark.skipif(
    find_chromium() is None, reason="chromium missing: bash scripts/setup-report-tools.sh"
)


def snakellm(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(BIN / "snakellm"), *args],
        cwd=cwd,
        env=env_with_venv(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def svg_text(path: Path) -> str:
    root = ET.parse(path).getroot()  # well-formed SVG, or this raises
    assert root.tag.endswith("svg")
    return " ".join(t for t in root.itertext())


# ---------------------------------------------------------------- data


@pytest.mark.slow  # ~2 s (a report rendered): the slow tier (fast-tier budget)
def test_data_report_counts_rejections_by_reason_with_example_lines(tmp_path):
    shard = tmp_path / "s1.jsonl"
    good = [json.dumps({"text": f"document {i}"}) for i in range(5)]
    shard.write_text(
        "\n".join(
            [
                good[0],
                "{not json",
                good[1],
                json.dumps({"other": "x"}),
                "",
                good[2],
                json.dumps({"text": "   "}),
                good[3],
                "[1, 2]",
                good[4],
                "{broken again",
            ]
        )
        + "\n"
    )
    shard2 = tmp_path / "s2.jsonl"
    shard2.write_text(json.dumps({"text": "fine"}) + "\n")
    for chunk, shards in (("chunk-00000", [shard]), ("chunk-00001", [shard2])):
        snakellm(
            "chunk",
            *map(str, shards),
            "--output",
            f"d/{chunk}.jsonl",
            "--source",
            "web",
            "--chunk",
            chunk,
            "--no-progress",
            cwd=tmp_path,
        )
    stats = json.loads((tmp_path / "d/chunk-00000.stats.json").read_text())
    snakellm(
        "report",
        "data",
        "d/chunk-00000.stats.json",
        "d/chunk-00001.stats.json",
        "--source",
        "web",
        "--table",
        "r/web.html",
        "--plot",
        "r/web.svg",
        cwd=tmp_path,
    )
    page = (tmp_path / "r/web.html").read_text()
    # every reason the chunk step counted is a column and a row, with its count and the bad line itself
    for reason, n in stats["rejected_by_reason"].items():
        assert n and f"<th>{reason}</th>" in page
        assert re.search(rf"<td>{reason}</td><td class=\"num\">{n}</td>", page), reason
    assert "{broken again" in page and "s1.jsonl:11" in page  # example content with shard and line number
    assert f'<td class="num">{stats["lines_read"] + 1}</td>' in page  # total lines read over both chunks
    text = svg_text(tmp_path / "r/web.svg")
    assert "invalid_json" in text and "rejected lines per chunk" in text
    snakellm(
        "report",
        "data-overview",
        "d/chunk-00000.stats.json",
        "d/chunk-00001.stats.json",
        "--output",
        "r/o.html",
        cwd=tmp_path,
    )
    assert '<td class="num">6</td>' in (tmp_path / "r/o.html").read_text()  # 5 + 1 documents


def test_bad_report_input_names_the_file(tmp_path):
    (tmp_path / "x.stats.json").write_text('{"chunk": "c"}')
    proc = subprocess.run(
        [
            str(BIN / "snakellm"),
            "report",
            "data",
            "x.stats.json",
            "--source",
            "s",
            "--table",
            "t.html",
            "--plot",
            "p.svg",
        ],
        cwd=tmp_path,
        env=env_with_venv(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert "x.stats.json: not a chunk stats file (no documents" in proc.stderr
    assert not (tmp_path / "t.html").exists()


def test_download_report_reads_manifests_and_counts_retries_from_the_log(tmp_path):
    from snakellm.report import data

    man = {
        "source": "web",
        "chunk": "chunk-00000",
        "size": 300,
        "shards": [
            {"url": "http://127.0.0.1:8/a.jsonl", "path": "a", "size": 100, "sha256": "0"},
            {"url": "http://127.0.0.1:8/b.jsonl", "path": "b", "size": 200, "sha256": "1"},
        ],
    }
    (tmp_path / "m.json").write_text(json.dumps(man))
    # the lines `snakellm download` writes (see snakellm/data/download.py)
    (tmp_path / "d.log").write_text(
        "http://127.0.0.1:8/a.jsonl: HTTP 429 Too Many Requests; retry 1/8 in 0.50s from byte 0\n"
        "http://127.0.0.1:8/a.jsonl: HTTP 503 Service Unavailable; retry 2/8 in 1.00s from byte 0\n"
        "m.json: 2 shards, 0.0 MB (0.0 MB fetched in 4 requests, 0 shards already complete) in 1.5 s\n"
    )
    page = data.download_table("web", [str(tmp_path / "m.json")], [str(tmp_path / "d.log")])
    assert '<td>chunk-00000</td><td class="num">2</td><td class="num">300</td>' in page
    assert '<td class="num">4</td><td class="num">2</td>' in page  # requests, retries
    assert "HTTP 429 Too Many Requests" in page and "127.0.0.1:8" in page


# ---------------------------------------------------------------- generic tables (later stages)


def test_table_step_renders_metrics_json_and_samples_jsonl(tmp_path):
    (tmp_path / "metrics.json").write_text(json.dumps({"task": "squad", "exact_match": 0.5, "rouge": {"f1": 0.25}}))
    (tmp_path / "samples.jsonl").write_text(
        "".join(json.dumps({"prompt": f"q{i}", "output": "<b>a</b>"}) + "\n" for i in range(60))
    )
    snakellm(
        "report",
        "table",
        "metrics.json",
        "samples.jsonl",
        "--title",
        "Evaluation: squad",
        "--output",
        "t.html",
        "--max-rows",
        "10",
        cwd=tmp_path,
    )
    page = (tmp_path / "t.html").read_text()
    assert '<td>rouge.f1</td><td class="num">0.25</td>' in page
    assert "<td>q9</td>" in page and "<td>q10</td>" not in page and "50 more records not shown" in page
    assert "&lt;b&gt;a&lt;/b&gt;" in page and "<b>a</b>" not in page  # model output is text, never markup


def test_table_step_shows_unicode_as_text(tmp_path):
    """Non-ASCII answers read as written (json.dumps' default would show \\u00a3 for a £)."""
    (tmp_path / "p.jsonl").write_text(
        json.dumps({"input": "Preis?", "answers": ["£5", "café"], "pred": "naïve ⁇"}, ensure_ascii=False) + "\n",
        encoding="utf-8",
    )
    snakellm("report", "table", "p.jsonl", "--title", "Preise", "--output", "t.html", cwd=tmp_path)
    page = (tmp_path / "t.html").read_text(encoding="utf-8")
    assert "£5" in page and "café" in page and "naïve ⁇" in page and "\\u00a3" not in page


@pytest.mark.slow  # ~2 s (a report rendered): the slow tier (fast-tier budget)
def test_lm_eval_and_finetune_pages_hold_the_files_values(tmp_path):
    """The Evaluation and Fine-tuning pages from files shaped as lm-eval and snakellm evaluate write them,
    NeMo's metric and field names (test_exact_string_match, inputs/preds/labels) as well as the older ones."""
    lm = {
        "results": {
            "t_ppl": {"alias": "t_ppl", "sample_len": 2, "word_perplexity,none": 1234.5, "word_perplexity_stderr,none": "N/A"},
            "t_mc": {"acc,none": 0.375, "acc_stderr,none": 0.125, "acc_norm,none": 0.5},
        },
        "n-samples": {"t_ppl": {"effective": 2}, "t_mc": {"effective": 8}},
        "n-shot": {"t_ppl": 0, "t_mc": 0},
        "samples": {"t_mc": [{"doc_id": 0, "arguments": {"gen_args_0": {"arg_0": "Le café"}}, "target": "£5",
                              "filtered_resps": [[-1.5, False]], "metrics": ["acc"], "acc": 1.0}]},
        "config": {"model": "hf"},
        "snakellm": {"suite": "default", "model_dir": "runs/r/hf", "limit": 8},
    }  # fmt: skip
    (tmp_path / "default.json").write_text(json.dumps(lm))
    snakellm("report", "lm-eval", "default.json", "--run", "r", "--table", "e.html", "--plot", "e.svg", cwd=tmp_path)
    page = (tmp_path / "e.html").read_text(encoding="utf-8")
    assert '<td>t_ppl</td><td>word_perplexity</td><td>none</td><td class="num">1,234</td>' in page
    assert '<td>t_mc</td><td>acc</td><td>none</td><td class="num">0.375</td><td class="num">0.125</td>' in page
    assert "sample_len" not in page and "Le café" in page and "£5" in page
    assert "t_mc acc" in svg_text(tmp_path / "e.svg") and "0.375" in svg_text(tmp_path / "e.svg")
    (tmp_path / "m.jsonl").write_text(
        "".join(json.dumps({"step": i, "loss": 5.0 - i / 10, **({"val_loss": 4.9} if i == 5 else {})}) + "\n" for i in range(1, 11))
    )  # fmt: skip
    (tmp_path / "s.json").write_text(
        json.dumps({"method": "lora", "base": "runs/r/checkpoints/iter_0000300", "steps": 10})
    )
    (tmp_path / "b.json").write_text(json.dumps({"test_exact_string_match": 0.0, "test_loss": 6.5, "examples": 2}))
    (tmp_path / "t.json").write_text(json.dumps({"test_exact_string_match": 0.5, "test_loss": 2.25, "examples": 2}))
    rows = [{"inputs": "Q: Größe?", "preds": "groß", "labels": "groß"}, {"inputs": "Q2", "preds": "x", "labels": "y"}]
    (tmp_path / "bp.jsonl").write_text("".join(json.dumps({**r, "preds": "?"}) + "\n" for r in rows))
    (tmp_path / "tp.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    snakellm(
        "report", "finetune", "--name", "ft", "--metrics", "m.jsonl", "--summary", "s.json", "--base", "b.json",
        "--tuned", "t.json", "--base-predictions", "bp.jsonl", "--tuned-predictions", "tp.jsonl",
        "--page", "f.html", "--loss", "f.svg", cwd=tmp_path,
    )  # fmt: skip
    page = (tmp_path / "f.html").read_text(encoding="utf-8")
    num = '<td class="num">{}</td>'.format
    assert "<td>test_exact_string_match</td>" + num(0) + num(0.5) + num(0.5) in page.replace("0.0<", "0<")
    assert "<td>test_loss</td>" + num(6.5) + num(2.25) + num(-4.25) in page
    assert "<td>Q: Größe?</td><td>groß</td><td>?</td><td>groß</td>" in page
    text = svg_text(tmp_path / "f.svg")
    assert "validation loss" in text and "best 4.900" in text


@pytest.mark.slow  # a Snakemake run in a subprocess: the slow tier (fast-tier budget)
def test_two_tables_with_one_label_in_one_menu_entry_are_refused(tmp_path):
    """register_report_table's label defaults to the title; the same (category, subcategory, label) twice is an error."""
    ws = Workspace(tmp_path)
    shutil.copytree(REPO / "resources" / "corpus" / "botchan", tmp_path / "corpus")
    ws.write_config(
        {"sources": {"b": {"kind": "local", "path": "corpus/*.jsonl", "format": "jsonl", "shards_per_chunk": 1}}}
    )
    stats = "data/jsonl/b/chunk-00000.stats.json"
    body = (
        f'include: "{SNAKEFILE}"\n\n'
        f'register_report_table("eval", "one", "{stats}", "Scores A", category="Evaluation", subcategory="x")\n'
        f'register_report_table("eval", "two", "{stats}", "Scores B", category="Evaluation", subcategory="x")\n'
        "%s"
        "rule everything:\n    input: get_all_targets()\n"
    )
    cmd = [str(BIN / "snakemake"), "-s", str(tmp_path / "eval.smk"), "-d", str(tmp_path), "--configfile"]
    cmd += [str(ws.config_path), "--replace-workflow-config", "-n", "everything"]
    (tmp_path / "eval.smk").write_text(body % "")
    ok = subprocess.run(cmd, cwd=tmp_path, env=env_with_venv(), capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]  # two titles: two labels
    for name in ("one", "two"):
        assert f"results/report/tables/eval/{name}.html" in ok.stdout
    clash = f'register_report_table("eval", "three", "{stats}", "Other", subcategory="x", category="Evaluation", figure="Scores A")\n'
    (tmp_path / "eval.smk").write_text(body % clash)
    bad = subprocess.run(cmd, cwd=tmp_path, env=env_with_venv(), capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    out = bad.stdout + bad.stderr  # snakemake 9 prints parse errors on stdout
    assert "'eval/three'" in out and "'eval/one'" in out and "same category" in out


@pytest.mark.slow
def test_a_registered_table_is_a_report_output_with_its_category(tmp_path):
    """The plug-in point for later stages: register_report_table(...) in a rules file."""
    ws = Workspace(tmp_path)
    shutil.copytree(REPO / "resources" / "corpus" / "botchan", tmp_path / "corpus")
    ws.write_config(
        {"sources": {"b": {"kind": "local", "path": "corpus/*.jsonl", "format": "jsonl", "shards_per_chunk": 1}}}
    )
    (tmp_path / "eval.smk").write_text(
        'include: "%s"\n\n'
        'rule fake_eval:\n    input: "data/jsonl/b/chunk-00000.stats.json"\n    output: "runs/x/eval/metrics.json"\n'
        '    shell: "cp {input} {output}"\n\n'
        'register_report_table("eval", "x-squad", "runs/x/eval/metrics.json", "Evaluation of x on SQuAD", category="Evaluation")\n\n'
        "rule everything:\n    input: get_all_targets()\n".replace("%s", str(SNAKEFILE))
    )
    cmd = [
        str(BIN / "snakemake"),
        "-s",
        str(tmp_path / "eval.smk"),
        "-d",
        str(tmp_path),
        "--configfile",
        str(ws.config_path),
        "--replace-workflow-config",
        "-c",
        "2",
        "--nocolor",
        "everything",
        "--omit-from",
        "dag",
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env_with_venv(), capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    page = (tmp_path / "results/report/tables/eval/x-squad.html").read_text()
    assert "Evaluation of x on SQuAD" in page and '<td>documents</td><td class="num">149</td>' in page


# ---------------------------------------------------------------- DAG pictures


@pytest.mark.slow
def test_dag_of_a_60000_shard_source_collapses_repeated_chunks(tmp_path):
    cfg = {
        "sources": {
            "slim": {
                "kind": "http",
                "format": "jsonl.zst",
                "shards_per_chunk": 800,
                "url": "https://example.invalid/train/chunk{1..10}/example_train_{0..5999}.jsonl.zst",
            }
        },
        "tokenizers": {
            "gpt2": {
                "kind": "gpt2-bpe",
                "vocab_file": str(REPO / "resources/tokenizers/gpt2/vocab.json"),
                "merges_file": str(REPO / "resources/tokenizers/gpt2/merges.txt"),
            }
        },
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    t0 = time.time()
    snakellm(
        "dag",
        "--rulegraph",
        "rg.svg",
        "--jobs",
        "jobs.svg",
        "--dot",
        "--snakefile",
        str(SNAKEFILE),
        "--",
        "--configfile",
        "c.yaml",
        "--replace-workflow-config",
        cwd=tmp_path,
    )
    took = time.time() - t0
    dot = (tmp_path / "jobs.dot").read_text()
    nodes = re.findall(r"^\t(\w+)\[label", dot, re.MULTILINE)
    assert len(nodes) < 40, len(nodes)  # 75 downloads + 75 chunks + 75 tokenize ... collapsed
    text = svg_text(tmp_path / "jobs.svg")
    assert text.count("… 72 more chunks") == 3  # download, chunk, tokenize: chunks 2 .. 73 of 75
    assert "(chunk-00002 … chunk-00073)" in text and "chunk-00074" in text and "chunk-00000" in text
    assert re.search(r"snakellm job DAG: \d+ jobs \(216 per-chunk jobs collapsed\)", text)
    assert "blend" in svg_text(tmp_path / "rg.svg")
    print(f"60,000-shard DAG pictures in {took:.1f} s")


def test_collapse_keeps_edges_between_collapsed_groups():
    from snakellm.report.dag import collapse_chunks, parse_dot

    head = "digraph snakemake_dag {\n    graph[bgcolor=white];\n"
    nodes = ['\t0[label = "all", color = "0", style="rounded"];']
    edges = []
    for i in range(6):
        nodes.append(f'\t{1 + i}[label = "chunk\\nchunk: chunk-{i:05d}\\nsource: s", color = "1", style="rounded"];')
        nodes.append(f'\t{10 + i}[label = "tokenize\\ntokenizer: t", color = "2", style="rounded"];')
        edges += [f"\t{1 + i} -> {10 + i}", f"\t{10 + i} -> 20"]
    nodes.append('\t20[label = "blend", color = "3", style="rounded"];')
    edges.append("\t20 -> 0")
    out, hidden = collapse_chunks(head + "\n".join(nodes + edges) + "\n}\n", head=2, tail=1)
    _, kept, kept_edges, _ = parse_dot(out)
    assert hidden == 6  # chunks 2, 3, 4 of each rule
    labels = {n: lab for n, (lab, _, _) in kept.items()}
    more = [n for n, lab in labels.items() if "3 more chunks" in lab]
    assert len(more) == 2
    chunk_more = next(n for n in more if labels[n].startswith("chunk"))
    tok_more = next(n for n in more if labels[n].startswith("tokenize"))
    assert (chunk_more, tok_more) in kept_edges and (tok_more, "20") in kept_edges
    assert ("1", "10") in kept_edges and ("6", "15") in kept_edges  # first and last chunk stay as they were


def path_without(tool: str, root: Path) -> str:
    """A PATH that finds everything the current one does except ``tool``.

    One directory of symlinks to the first hit of every executable on PATH (the venv's bin
    first, as subprocesses see it), ``tool`` left out: removing the directory that holds
    ``dot`` would also remove bash and coreutils, which live next to it in /usr/bin.
    """
    bindir = root / f"bin-without-{tool}"
    bindir.mkdir()
    for d in env_with_venv()["PATH"].split(os.pathsep):
        if not d or not os.path.isdir(d):
            continue
        for entry in os.scandir(d):
            link = bindir / entry.name
            if entry.name != tool and not link.exists() and os.access(entry.path, os.X_OK):
                link.symlink_to(entry.path)
    path = str(bindir)
    assert shutil.which(tool, path=path) is None and shutil.which("snakemake", path=path)
    return path


@pytest.mark.slow
def test_default_workflow_draws_its_dag_without_graphviz(tmp_path):
    """A plain `pip install` has no `dot`: the default target's dag rule still draws both pictures."""
    shutil.copytree(REPO / "resources", tmp_path / "resources")
    shutil.copy(REPO / "config" / "config.yaml", tmp_path / "config.yaml")
    ws = Workspace(tmp_path)
    targets = ["results/report/workflow/rulegraph.svg", "results/report/workflow/jobs.svg"]
    env = env_with_venv()
    env["PATH"] = path_without("dot", tmp_path)
    proc = subprocess.run(
        [str(BIN / "snakemake"), "-s", str(SNAKEFILE), "-d", str(tmp_path), "--configfile", str(ws.config_path)]
        + ["--replace-workflow-config", "-c", "2", "--nocolor", *targets],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = ws.path("logs/report/dag.log").read_text()
    assert log.count("Graphviz's `dot` not found") == 1, log  # one warning line for both pictures
    rules = set(
        re.findall(
            r"^\s*rule (\w+):", "\n".join(p.read_text() for p in [SNAKEFILE, *(REPO / "rules").glob("*.smk")]), re.M
        )
    )
    rg = svg_text(ws.path(targets[0]))
    drawn = set(rg.split())
    for rule in (
        "all",
        "chunk",
        "tokenize",
        "train_tokenizer",
        "blend",
        "pretrain",
        "export_hf",
        "dag",
        "report_train",
    ):
        assert rule in drawn and rule in rules, rule
    assert "(drawn without Graphviz)" in rg and re.search(r"snakellm rule graph: \d+ rules", rg)
    jobs = svg_text(ws.path(targets[1]))
    assert "chunk-00000" in jobs and "run: tiny" in jobs and "tokenizer: spm2k" in jobs
    assert re.search(r"snakellm job DAG: \d+ jobs", jobs)


@pytest.mark.slow
def test_dag_reruns_only_when_its_pictures_can_change(tmp_path):
    """The dag rule's trigger is a digest of the graph it draws: a training setting or a source's weight
    reruns nothing there, a new source does; `snakemake -n` never prints the config as the reason."""
    from conftest import small_config

    ws = Workspace(tmp_path)
    cfg = small_config(tmp_path)
    gpt2 = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["tokenizers"]["gpt2"]
    cfg["tokenizers"] = {"gpt2": gpt2 | {k: str(REPO / gpt2[k]) for k in ("vocab_file", "merges_file")}}
    cfg["runs"] = {"tiny": {"tokenizer": "gpt2", "model": {"preset": "tiny"}}}
    cfg["runs"]["tiny"]["train"] = {"steps": 10, "micro_batch_size": 2, "global_batch_size": 2}
    ws.write_config(cfg)
    target = "results/report/workflow/jobs.svg"
    ws.run(target)
    assert "botchan" in svg_text(ws.path(target))
    for edit in (
        lambda c: c["runs"]["tiny"]["train"].update(steps=20, lr=1e-3),
        lambda c: c["sources"]["botchan"].update(weight=0.25),
    ):
        edit(cfg)
        ws.write_config(cfg)
        dry = ws.run("-n", target)
        assert "Nothing to be done" in dry.stdout + dry.stderr, dry.stdout[-3000:]
    cfg["sources"]["botchan2"] = dict(cfg["sources"]["botchan"])
    ws.write_config(cfg)
    dry = ws.run("-n", target)
    out = dry.stdout + dry.stderr
    assert "rule dag:" in out and "Params have changed" in out, out[-3000:]
    assert "shards_per_chunk" not in out and len(out) < 5000, out  # two digests, not the config
    ws.run(target)
    assert "botchan2" in svg_text(ws.path(target))


def test_landing_rule_graph_has_each_rule_once_below_its_inputs():
    """Two tokenizers, one trained: `tokenize` follows `chunk` and `train_tokenizer` (jobs at two depths)."""
    from snakellm.report.landing import rule_spec

    edges = [("chunk", "tokenize"), ("chunk", "train_tokenizer"), ("train_tokenizer", "tokenize")]
    edges += [("tokenize", "blend"), ("tokenize", "blend"), ("blend", "all"), ("chunk", "all"), ("all", "all")]
    spec, _, ymax = rule_spec(["chunk", "tokenize", "train_tokenizer", "blend", "all"], edges)
    order = [n["rule"] for n in spec["nodes"]]
    assert order == ["chunk", "train_tokenizer", "tokenize", "blend", "all"]
    assert ymax == 200
    links = {(x["sourcerule"], x["targetrule"]) for x in spec["links"] + spec["links_direct"]}
    assert links == set(edges) - {("all", "all")}
    assert len(spec["links"]) + len(spec["links_direct"]) == len(links)
    assert all(x["target"] - x["source"] == 1 for x in spec["links_direct"])
    assert all(x["target"] - x["source"] > 1 for x in spec["links"])


@pytest.mark.slow
def test_report_landing_page_draws_each_rule_once(tmp_path):
    """`snakemake --report` on the data and tokenize stages of the default config (GPT-2 BPE and a trained
    SentencePiece): its landing page's rule graph had tokenize, blend, report_tokens and report_tokenizer twice."""
    from conftest import small_config

    ws = Workspace(tmp_path)
    cfg = small_config(tmp_path)
    default = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    gpt2 = default["tokenizers"]["gpt2"]
    cfg["tokenizers"] = {
        "gpt2": gpt2 | {k: str(REPO / gpt2[k]) for k in ("vocab_file", "merges_file")},
        "spm": default["tokenizers"]["spm2k"] | {"vocab_size": 500},
    }
    ws.write_config(cfg)
    ws.run()
    ws.run("--report", "report.html")
    html = ws.path("report.html").read_text()
    nodes = json.loads(re.search(r'"node-data", "values": (\[.*?\])', html).group(1))
    links = [
        link
        for key in ("link-data", "link-data-direct")
        for link in json.loads(re.search(rf'"{key}", "values": (\[.*?\])', html).group(1))
    ]
    rules = [n["rule"] for n in nodes]
    assert len(rules) == len(set(rules)), rules
    assert {"chunk", "train_tokenizer", "tokenize", "blend", "report_tokens", "report_tokenizer"} <= set(rules)
    pairs = {(x["sourcerule"], x["targetrule"]) for x in links}
    assert {("chunk", "tokenize"), ("train_tokenizer", "tokenize"), ("tokenize", "blend")} <= pairs, pairs
    assert all(rules[x["source"]] == x["sourcerule"] and x["source"] < x["target"] for x in links)


def test_layered_svg_draws_inputs_above_consumers_without_overlaps():
    from snakellm.report.dag import parse_dot
    from snakellm.report.layered_svg import to_svg

    text = (
        "digraph snakemake_dag {\n    graph[bgcolor=white];\n"
        '\t0[label = "all", color = "0.00 0.6 0.85", style="rounded"];\n'
        '\t1[label = "chunk\\nchunk: chunk-00000", color = "0.05 0.6 0.85", style="rounded"];\n'
        '\t2[label = "chunk\\nchunk: chunk-00001", color = "0.05 0.6 0.85", style="rounded"];\n'
        '\t3[label = "tokenize", color = "0.61 0.6 0.85", style="rounded,dashed"];\n'
        '\t4[label = "blend & <mix>", color = "0.03 0.6 0.85", style="rounded"];\n'
        "\t1 -> 3\n\t2 -> 3\n\t3 -> 4\n\t4 -> 0\n\t1 -> 0\n}\n"
    )
    _, nodes, edges, _ = parse_dot(text)
    svg = to_svg("a <title>", nodes, edges)
    root = ET.fromstring(svg.encode())
    ns = {"s": "http://www.w3.org/2000/svg"}
    boxes = {}  # by the label's last line
    for g in root.findall("s:g", ns):
        r = g.find("s:rect", ns)
        lines = [t.text for t in g.findall("s:text", ns)]
        x, y, w, h = (float(r.get(k)) for k in ("x", "y", "width", "height"))
        boxes[lines[-1]] = {
            "x": x,
            "y": y,
            "w": w,
            "lines": lines,
            "stroke": r.get("stroke"),
            "dash": r.get("stroke-dasharray"),
        }
    assert set(boxes) == {"all", "chunk: chunk-00000", "chunk: chunk-00001", "tokenize", "blend & <mix>"}
    assert boxes["chunk: chunk-00001"]["lines"] == ["chunk", "chunk: chunk-00001"]
    top = {k: b["y"] for k, b in boxes.items()}
    # every input sits above its consumer; the long edge chunk-00000 -> all does not shorten the chain
    assert top["chunk: chunk-00000"] == top["chunk: chunk-00001"] < top["tokenize"] < top["blend & <mix>"] < top["all"]
    a, b = sorted((boxes["chunk: chunk-00000"], boxes["chunk: chunk-00001"]), key=lambda b: b["x"])
    assert a["x"] + a["w"] < b["x"], "boxes in a layer overlap"
    assert boxes["tokenize"]["dash"] and not boxes["all"]["dash"]
    assert boxes["all"]["stroke"] == "#d95757"  # Snakemake's "0.00 0.6 0.85" as RGB
    assert len(root.findall("s:path", ns)) == 5 and root.find("s:title", ns).text == "a <title>"
    assert float(root.get("width")) > 200 and float(root.get("height")) > 100


# ---------------------------------------------------------------- the whole report, in a browser


def artifacts_dir() -> Path:
    base = Path(os.environ.get("SNAKELLM_ARTIFACTS", REPO / "test-artifacts"))
    d = base / "report"
    d.mkdir(parents=True, exist_ok=True)
    return d


CHECK_RESULTS = """
(async () => {
  const out = {};
  for (const [path, r] of Object.entries(results)) {
    const rec = {mime: r.mime_type, caption: r.caption.length, labels: r.labels};
    if (r.mime_type.startsWith("image/")) {
      const img = new Image();
      const ok = await new Promise(res => { img.onload = () => res(true); img.onerror = () => res(false); img.src = r.data_uri; });
      rec.loaded = ok; rec.width = img.naturalWidth; rec.height = img.naturalHeight;
    } else {
      rec.data = r.data_uri;
    }
    out[path] = rec;
  }
  return out;
})()
"""

CLICK = """
((text) => {
  const els = [...document.querySelectorAll('nav a, nav li, nav td, nav span, nav div')]
    .filter(e => e.textContent.trim() === text && e.offsetParent !== null);
  if (!els.length) return false;
  els[els.length - 1].click();
  return true;
})(%s)
"""

SHOW = """
((label) => {
  const row = [...document.querySelectorAll('nav tr, nav li')].find(e => e.textContent.trim().startsWith(label));
  if (!row) return "no row " + label;
  const links = row.querySelectorAll('a');
  if (!links.length) return "no link in row " + label;
  links[0].click();  // the eye: show the result
  return "ok";
})(%s)
"""


def _decode(uri: str) -> str:
    return base64.b64decode(uri.split(",", 1)[1]).decode()


@pytest.mark.slow
@NEEDS_CHROMIUM
def test_report_of_the_default_workflow_in_headless_chromium(default_workflow, tmp_path, capsys):
    from chromium import Chromium

    ws = default_workflow
    t0 = time.time()
    ws.run("--report", "report.html")
    report = ws.path("report.html")
    assert report.stat().st_size > 100_000
    summary = json.loads(ws.path("runs/tiny/train_summary.json").read_text())
    blend = json.loads(ws.path("data/tokens/spm2k/blend.json").read_text())
    shots = artifacts_dir()
    with Chromium(tmp_path / "profile") as c:
        c.open(report.as_uri())
        for _ in range(100):
            if c.js("document.querySelector('nav') !== null && typeof categories !== 'undefined'"):
                break
            time.sleep(0.1)
        assert set(c.js("Object.keys(categories)")) == {
            "DAG",
            "Data",
            "Tokens",
            "Training",
            "Evaluation",
            "Generation",
        }
        assert c.js("Object.keys(categories['Training'])") == ["tiny"]
        assert set(c.js("Object.keys(categories['Data'])")) == {"All sources", "wikitext", "botchan"}
        assert set(c.js("Object.keys(categories['Tokens'])")) == {"All tokenizers", "gpt2", "spm2k"}
        got = c.js(CHECK_RESULTS)
        names = {Path(p).name for p in got}
        expected = {
            "rulegraph.svg",
            "jobs.svg",
            "overview.html",
            "overview.svg",
            "wikitext.chunks.html",
            "wikitext.chunks.svg",
            "botchan.chunks.svg",
            "spm2k.tokens.html",
            "spm2k.blend.svg",
            "spm2k.doc_tokens.svg",
            "spm2k.tokenizer.html",
            "gpt2.tokenizer.html",
            "tiny.loss.svg",
            "tiny.lr.svg",
            "tiny.grad_norm.svg",
            "tiny.throughput.svg",
            "tiny.summary.html",
        }
        assert expected <= names, expected - names
        for path, r in got.items():
            assert r["caption"] > 50, f"{path}: no caption"
            if r["mime"].startswith("image/"):
                assert r["loaded"] and r["width"] > 200 and r["height"] > 100, f"broken image {path}: {r}"
            else:
                assert r["mime"] == "text/html" and "<table>" in _decode(r["data"]), path
        # the tables hold the workflow's real figures
        page = {"/".join(Path(p).parts[-2:]): _decode(r["data"]) for p, r in got.items() if "data" in r}
        assert f"{summary['final_val_loss']:.4g}" in page["train/tiny.summary.html"]
        assert "iter_0000300" in page["train/tiny.summary.html"]  # the kept checkpoints
        assert f"{blend['tokens']:,}" in page["tokens/spm2k.tokens.html"]
        assert "<td>all</td>" in page["data/overview.html"] and "<td>spm2k</td>" in page["tokens/overview.html"]
        assert '<span class="piece">' in page["tokens/spm2k.tokenizer.html"]

        # click through like a person and keep what it looked like
        c.screenshot(shots / "01-start.png")
        assert c.js(CLICK % json.dumps("Training")), "no Training category in the menu"
        time.sleep(0.3)
        assert c.js(SHOW % json.dumps("1. loss")) == "ok"
        time.sleep(0.5)
        shown = c.js(
            "[...document.querySelectorAll('img')].filter(i => i.src.includes('image/svg')).map(i => [i.complete, i.naturalWidth])"
        )
        assert any(ok and w > 200 for ok, w in shown), shown
        c.screenshot(shots / "02-training-loss.png")
        c.js("app.setView({navbarMode: 'menu'})")
        assert c.js(CLICK % json.dumps("Data"))
        time.sleep(0.3)
        assert c.js(CLICK % json.dumps("wikitext"))
        time.sleep(0.3)
        assert c.js(SHOW % json.dumps("documents and rejected lines per chunk")) == "ok"
        time.sleep(0.5)
        c.screenshot(shots / "03-data-wikitext.png")
        c.js("app.setView({navbarMode: 'menu'})")
        assert c.js(CLICK % json.dumps("DAG"))
        time.sleep(0.3)
        assert c.js(SHOW % json.dumps("rule graph")) == "ok"
        time.sleep(0.5)
        c.screenshot(shots / "04-rulegraph.png")
        c.js("app.setView({navbarMode: 'menu'})")
        assert c.js(CLICK % json.dumps("Tokens"))
        time.sleep(0.3)
        assert c.js(CLICK % json.dumps("spm2k"))
        time.sleep(0.3)
        assert c.js(SHOW % json.dumps("tokens per source and chunk (table)")) == "ok"
        time.sleep(1.0)
        assert c.js("document.querySelectorAll('iframe').length") == 1  # the table page, shown in the report
        c.screenshot(shots / "05-tokens-table.png")
    for name in (
        "01-start.png",
        "02-training-loss.png",
        "03-data-wikitext.png",
        "04-rulegraph.png",
        "05-tokens-table.png",
    ):
        assert (shots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shutil.copy(report, shots / "report.html")
    with capsys.disabled():
        print(f"\nreport screenshots ({time.time() - t0:.0f} s): {shots}/0[1-5]-*.png, report: {shots}/report.html")


FINETUNE_EXAMPLE = REPO / "config/examples/tiny-squad-finetune.yaml"


def _fmt(v: float) -> str:
    """A number as the report's tables print it (snakellm.report.html.fmt)."""
    from snakellm.report.html import fmt

    return fmt(v)


@pytest.fixture(scope="module")
def finetuned_report(default_workflow, tmp_path_factory) -> Workspace:
    """A copy of the default run plus the fine-tuning example's two fine-tunes, their evaluations and the report,
    built through Snakemake (a shared fixture: two fine-tunes, four evaluations, two lm-eval suites; ~105 s
    alone, 129 s of CPU in CI, over the 120 s a test has of its own)."""
    root = tmp_path_factory.mktemp("finetuned-report") / "ws"
    shutil.copytree(default_workflow.root, root, symlinks=True)
    ws = Workspace(root)
    cfg = ws.read_config()
    example = yaml.safe_load(FINETUNE_EXAMPLE.read_text())
    cfg.update(sft_data=example["sft_data"], finetune=example["finetune"])
    # the report's pages, not the learning (tests/test_finetune.py, test_lora_chain.py): a third of the steps
    cfg["finetune"]["tiny-counts"]["train"].update(steps=20, eval_interval=10)
    cfg["finetune"]["tiny-lora"]["train"].update(steps=12, eval_interval=4)
    ws.write_config(cfg)
    ws.run(timeout=1800)
    ws.run("--report", "report.html")
    return ws


@pytest.mark.slow
@NEEDS_CHROMIUM
def test_report_shows_evaluation_finetuning_and_generation_in_headless_chromium(finetuned_report, tmp_path):
    """The default run plus the fine-tuning example: Evaluation (lm-eval), Fine-tuning (loss, base vs tuned,
    predictions, settings) and Generation (samples) in the report, each holding the files' real values."""
    from chromium import Chromium

    ws = finetuned_report
    lm = json.loads(ws.path("runs/tiny/lm_eval/default.json").read_text())
    # the learning example (tiny-counts): its base evaluation is shared by the fine-tunes of its data set
    (base_dir,) = ws.path("runs/tiny/eval/base/botchan-counts").iterdir()
    base = json.loads((base_dir / "metrics.json").read_text())
    tuned = json.loads(ws.path("runs/tiny/eval/tiny-counts/tuned/metrics.json").read_text())
    preds_file = ws.path("runs/tiny/eval/tiny-counts/tuned/predictions.jsonl")
    preds = [json.loads(x) for x in preds_file.read_text().splitlines()]
    comparison = json.loads(ws.path("runs/tiny/eval/tiny-counts/comparison.json").read_text())
    samples = [json.loads(x) for x in ws.path("runs/tiny/samples.jsonl").read_text().splitlines()]
    with Chromium(tmp_path / "profile") as c:
        c.open(ws.path("report.html").as_uri())
        for _ in range(100):
            if c.js("document.querySelector('nav') !== null && typeof categories !== 'undefined'"):
                break
            time.sleep(0.1)
        cats = c.js("Object.fromEntries(Object.entries(categories).map(([k, v]) => [k, Object.keys(v)]))")
        assert cats["Evaluation"] == ["tiny"] and cats["Generation"] == ["tiny"]
        assert sorted(cats["Fine-tuning"]) == ["tiny-counts", "tiny-lora"]
        got = c.js(CHECK_RESULTS)
        by_name = {"/".join(Path(p).parts[-2:]): r for p, r in got.items()}
        labels = {
            k: r["labels"]["figure"]
            for k, r in by_name.items()
            if k.startswith(("evaluation/", "tiny/", "generation/"))
        }
        assert labels == {
            "evaluation/tiny.lm_eval.html": "lm-eval suites (table)",
            "evaluation/tiny.lm_eval.svg": "lm-eval scores",
            "tiny/tiny-lora.html": "base vs tuned, predictions, settings",
            "tiny/tiny-lora.loss.svg": "loss",
            "tiny/tiny-counts.html": "base vs tuned, predictions, settings",
            "tiny/tiny-counts.loss.svg": "loss",
            "generation/tiny.html": "samples",
        }
        for k in ("evaluation/tiny.lm_eval.svg", "tiny/tiny-lora.loss.svg", "tiny/tiny-counts.loss.svg"):
            assert by_name[k]["loaded"] and by_name[k]["width"] > 200, k
        page = {k: _decode(r["data"]) for k, r in by_name.items() if "data" in r}
        ev = page["evaluation/tiny.lm_eval.html"]
        for task, key in (
            ("snakellm_wikitext", "word_perplexity,none"),
            ("snakellm_wikitext", "bits_per_byte,none"),
            ("snakellm_lambada", "acc,none"),
            ("snakellm_cont4", "acc_norm,none"),
            ("snakellm_squad", "exact_match,strip"),
        ):
            metric, _, filt = key.partition(",")
            value = _fmt(lm["results"][task][key])
            assert f'<td>{task}</td><td>{metric}</td><td>{filt}</td><td class="num">{value}</td>' in ev, (task, key)
        assert '<td class="num">40</td>' in ev  # documents scored (the suite's limit)
        # the fine-tunes' own models (full SFT's hf/, LoRA's merged one), evaluated with the same suite
        merged = json.loads(ws.path("runs/tiny/finetune/tiny-counts/lm_eval/default.json").read_text())
        assert merged["snakellm"]["model_dir"] == "runs/tiny/finetune/tiny-counts/hf"
        tables = ev.split("<h2>")
        assert len([t for t in tables if t.startswith("suite default (")]) == 3  # the run, its two fine-tunes
        (ft_table,) = [t for t in tables if t.startswith("suite default (runs/tiny/finetune/tiny-counts/hf)")]
        value = _fmt(merged["results"]["snakellm_cont4"]["acc,none"])
        assert f'<td>snakellm_cont4</td><td>acc</td><td>none</td><td class="num">{value}</td>' in ft_table
        ft = page["tiny/tiny-counts.html"]
        for r in comparison["metrics"]:  # the comparison file's table, with which way is better
            better = "higher" if r["higher_is_better"] else "lower"
            cells = "".join(f'<td class="num">{_fmt(r[k])}</td>' for k in ("base", "tuned", "difference"))
            assert f"<td>{r['metric']}</td>{cells}<td>{better}</td>" in ft, r
        compared = [k for k, b in base.items() if isinstance(b, float) and isinstance(tuned.get(k), float)]
        assert len(compared) >= 3, compared  # exact match, SQuAD EM/F1, loss: whatever their names
        for key in compared:
            b, t = base[key], tuned[key]
            row = f'<td>{key}</td><td class="num">{_fmt(b)}</td><td class="num">{_fmt(t)}</td>'
            assert row + f'<td class="num">{_fmt(t - b)}</td>' in ft, key
        assert ft.count("<tr>") > 10  # comparison, 10 example predictions, settings
        from html import escape

        assert escape(preds[0]["pred"]) in ft and escape(preds[0]["input"]) in ft
        gen = page["generation/tiny.html"]
        for s in samples:
            assert escape(s["prompt"]) in gen and escape(s["completion"].strip()[:40]) in gen
        for text in page.values():
            assert not re.search(r"\\u[0-9a-f]{4}", text)  # Unicode as text, never escaped
        # click through like a person: the Evaluation table opens in the report's frame
        assert c.js(CLICK % json.dumps("Evaluation")), "no Evaluation category in the menu"
        time.sleep(0.3)
        c.js(CLICK % json.dumps("tiny"))  # a category of one subcategory opens it at once
        time.sleep(0.3)
        assert c.js(SHOW % json.dumps("lm-eval suites (table)")) == "ok"
        time.sleep(1.0)
        assert c.js("document.querySelectorAll('iframe').length") == 1
        c.screenshot(artifacts_dir() / "06-evaluation.png")
        c.js("app.setView({navbarMode: 'menu'})")
        assert c.js(CLICK % json.dumps("Fine-tuning"))
        time.sleep(0.3)
        assert c.js(CLICK % json.dumps("tiny-counts"))
        time.sleep(0.3)
        assert c.js(SHOW % json.dumps("loss")) == "ok"
        time.sleep(0.5)
        c.screenshot(artifacts_dir() / "07-finetune-loss.png")
