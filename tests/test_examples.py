"""The example configs are valid and plan as documented (real `snakemake -n`, nothing fetched)."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from conftest import REPO

from snakellm.config import validate as cfgmod
from snakellm.data.planning import read_shard_list

EXAMPLES = sorted((REPO / "config" / "examples").glob("*.yaml"))
SCHEMA = cfgmod.load_schema(REPO / "config" / "schema.yaml")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_is_valid(path):
    cfgmod.validate(yaml.safe_load(path.read_text()), SCHEMA)


@pytest.mark.slow  # a Snakemake run in a subprocess: the slow tier (fast-tier budget)
def test_slimpajama_example_plans_75_jobs_per_stage(workspace):
    shutil.copytree(REPO / "resources" / "tokenizers", workspace.root / "resources" / "tokenizers")
    shutil.copy(REPO / "config" / "examples" / "slimpajama-gpt2-124m.yaml", workspace.config_path)
    out = workspace.run("-n").stdout
    stats = out.split("Job stats:", 1)[1]
    counts = {
        ln.split()[0]: int(ln.split()[1])
        for ln in stats.splitlines()[3:]
        if len(ln.split()) == 2 and ln.split()[1].isdigit()
    }
    assert counts["download"] == counts["chunk"] == counts["tokenize"] == 75  # 60,000 shards / 800 a chunk
    assert counts["blend"] == 1 and counts["pretrain"] == 1


EIGHT_B = REPO / "config" / "examples" / "slimpajama-gpt-8b.yaml"


@pytest.mark.slow  # 3.4 s of CPU, among the fast tier's slowest (the tier ran 76-89 s of its 90 s budget)
def test_8b_example_fits_8_nodes_of_8_gpus_and_says_so(capsys):
    """NeMo's 7b_improved recipe: the batch/parallelism check for 8 x 8 GPUs and the memory per GPU."""
    from snakellm.steps import plan as plan_cli

    assert plan_cli.main(["--config", str(EIGHT_B), "--nodes", "8", "--gpus-per-node", "8", "--run", "gpt-8b"]) == 0
    out = capsys.readouterr().out
    assert "slimpajama: 60000 shards -> 75 chunks" in out
    assert (
        "run gpt-8b: 64 ranks = 8 nodes x 8; tp 4 x pp 1 x dp 16; global batch 512 = micro batch 1 x dp 16 x 32" in out
    )
    assert (
        "llama 6841.4M params: 32 layers, hidden 4096, 32 heads (32 KV groups), ffn 10880, seq 2048, vocab 50688" in out
    )
    assert "total           32.35 GiB" in out and "fits in 80 GiB GPUs" in out
    # the same from the run's own allocation (runs.gpt-8b.resources), no flag and no environment variable
    assert plan_cli.main(["--config", str(EIGHT_B), "--run", "gpt-8b"]) == 0
    out = capsys.readouterr().out
    assert "run gpt-8b: 64 ranks = 8 nodes x 8; tp 4 x pp 1 x dp 16;" in out
    assert (
        "  job (runs.gpt-8b.resources): 8 nodes x 8 GPUs = 64 ranks, 8 CPUs per GPU, time limit 1440 min, "
        "container nvcr.io/nvidia/pytorch:25.04-py3" in out
    )
    assert "total           32.35 GiB" in out
    # a layout the batch does not divide over: an error with the numbers, exit status 2
    assert plan_cli.main(["--config", str(EIGHT_B), "--nodes", "3", "--gpus-per-node", "8", "--run", "gpt-8b"]) == 2
    assert (
        "global batch size 512 is not divisible by micro batch size 1 x data-parallel size 6" in capsys.readouterr().out
    )


def _gpt2_blend(root):
    """A blend of GPT-2 token ids with documents enough for the recipe's 99990,8,2 split (20,000 of 8 tokens)."""
    import json

    import numpy as np

    from snakellm.tokenize.indexed import IndexedWriter, prefix_paths

    prefix = root / "data/tokens/gpt2/slimpajama/chunk-00000_text_document"
    prefix.parent.mkdir(parents=True)
    with IndexedWriter(*prefix_paths(prefix), np.uint16) as w:
        w.add_documents(np.arange(20000 * 8, dtype=np.int64).astype(np.uint16) % 50257, np.full(20000, 8, np.int32))
        w.finalize()
    blend = root / "data/tokens/gpt2/blend.json"
    tok = {"name": "gpt2", "kind": "gpt2-bpe", "vocab_size": 50257, "eod_id": 50256}
    blend.write_text(json.dumps({"data_prefix": [1.0, str(prefix)], "tokenizer": tok}))
    return blend


@pytest.mark.slow  # a dry run of the 8B training step: the slow tier (fast-tier budget)
def test_8b_example_train_dry_run_checks_the_8_node_layout_and_prints_the_memory_per_gpu(tmp_path, capsys):
    """`snakellm train --dry-run` with the pretrain rule's own flags for the recipe: no torch, the plan's numbers."""
    import shlex
    import subprocess
    import sys

    from conftest import env_with_venv

    from snakellm.config import resolve
    from snakellm.steps import plan as plan_cli

    cfg = yaml.safe_load(EIGHT_B.read_text())
    run = cfg["runs"]["gpt-8b"]
    flags = shlex.split(resolve.train_flags(run, resolve.resolve_runs(cfg)["gpt-8b"]))
    blend = _gpt2_blend(tmp_path)
    argv = ["--blend", str(blend), "--run-dir", str(tmp_path / "runs/gpt-8b"), *flags, "--dry-run"]
    probe = (
        "import sys; from snakellm.steps.train import main; rc = main(sys.argv[1:]); "
        "print('exit', rc, 'torch' in sys.modules, 'megatron' in sys.modules)"
    )

    def dry_run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", probe, *argv, *extra],
            cwd=tmp_path,
            env=env_with_venv(),
            capture_output=True,
            text=True,
            timeout=120,
        )

    proc = dry_run("--nodes", "8", "--gpus-per-node", "8")
    out = proc.stdout
    assert out.splitlines()[-1] == "exit 0 False False", proc.stderr  # valid, and neither torch nor megatron imported
    assert (
        "run gpt-8b: 64 ranks = 8 nodes x 8; tp 4 x pp 1 x dp 16; global batch 512 = micro batch 1 x dp 16 x 32 "
        "accumulation steps; 300000 steps of 1,048,576 tokens" in out
    )
    assert "  model: llama 6841.4M params: 32 layers, hidden 4096, 32 heads (32 KV groups), ffn 10880" in out
    assert f"checkpoints: starts fresh in {tmp_path / 'runs/gpt-8b/checkpoints'}" in out
    assert not (tmp_path / "runs").exists()  # nothing written
    memory = out[out.index("  memory per GPU") : out.index("exit 0")].splitlines()
    assert memory[:7] == [
        "  memory per GPU (tp 4 x pp 1 x dp 16, micro batch 1, optimizer replicated, sequence parallel off, "
        "recompute none):",
        "    weights          3.19 GiB  (1,710.8M parameters on this GPU)",
        "    gradients        6.37 GiB",
        "    optimizer       19.12 GiB",
        "    activations      3.67 GiB",
        "    total           32.35 GiB  (+ ~1-3 GiB CUDA context and workspaces, not counted)",
        "    fits in 80 GiB GPUs (with 10% + 2 GiB headroom)",
    ]
    assert "parallel.sequence_parallel: true and parallel.distributed_optimizer: true would make it 12.91 GiB" in out
    # one estimate: `snakellm plan` prints the same lines for the same layout
    assert plan_cli.main(["--config", str(EIGHT_B), "--nodes", "8", "--gpus-per-node", "8", "--run", "gpt-8b"]) == 0
    assert "\n".join(memory[:7]) in capsys.readouterr().out  # then each says where it runs (a note on the CPU)

    # the job from the recipe's own config (runs.gpt-8b.resources): the same layout and memory, and the allocation
    proc = dry_run("--config", str(EIGHT_B))
    assert proc.stdout.splitlines()[-1] == "exit 0 False False", proc.stderr
    assert "run gpt-8b: 64 ranks = 8 nodes x 8; tp 4 x pp 1 x dp 16;" in proc.stdout
    assert (
        "  job (runs.gpt-8b.resources): 8 nodes x 8 GPUs = 64 ranks, 8 CPUs per GPU, time limit 1440 min" in proc.stdout
    )
    assert "\n".join(memory[:7]) in proc.stdout

    # with both options on: the optimizer states sharded over 16 ranks, the activations outside TP split by 4
    out = dry_run("--nodes", "8", "--gpus-per-node", "8", "--sequence-parallel", "--distributed-optimizer").stdout
    assert "tp 4 x pp 1 x dp 16 (sequence parallel, distributed optimizer);" in out
    assert "distributed optimizer, sequence parallel on" in out
    assert "    optimizer        1.19 GiB" in out and "    activations      2.15 GiB" in out
    assert (
        "    total           12.91 GiB" in out and "parallel.sequence_parallel: true" not in out
    )  # (FSDP is still offered)

    # a layout the batch does not divide over: exit status 2 with the numbers, before torch
    proc = dry_run("--nodes", "3", "--gpus-per-node", "8")
    assert proc.stdout.split()[-4:] == ["exit", "2", "False", "False"]
    assert "global batch size 512 is not divisible by micro batch size 1 x data-parallel size 6" in proc.stderr


@pytest.mark.slow
def test_8b_example_dry_runs_with_its_8_node_srun_line(workspace):
    from snakellm.launch.prefix import launch_prefix

    shutil.copytree(REPO / "resources" / "tokenizers", workspace.root / "resources" / "tokenizers")
    shutil.copy(EIGHT_B, workspace.config_path)
    out = workspace.run("-n").stdout
    stats = out.split("Job stats:", 1)[1]
    counts = {
        ln.split()[0]: int(ln.split()[1])
        for ln in stats.splitlines()[3:]
        if len(ln.split()) == 2 and ln.split()[1].isdigit()
    }
    assert counts["download"] == counts["chunk"] == counts["tokenize"] == 75 and counts["pretrain"] == 1
    assert "--tp 4" in out and "--global-batch-size 512" in out and "--micro-batch-size 1" in out
    cfg = yaml.safe_load(EIGHT_B.read_text())
    container = cfg["runs"]["gpt-8b"]["resources"]["container"]
    line = launch_prefix({"mpi": "srun", "nodes": 8, "tasks": 64, "cpus_per_task": 8}, container, "/work")
    assert line.startswith(
        "srun --nodes=8 --ntasks=64 --ntasks-per-node=8 --cpus-per-task=8 --kill-on-bad-exit=1 "
        "--container-image=nvcr.io/nvidia/pytorch:25.04-py3"
    )


@pytest.mark.slow
def test_wikipedia_example_plans_one_chunk_per_dump_file(workspace):
    cfg = yaml.safe_load((REPO / "config" / "examples" / "wikipedia-gpt2-124m.yaml").read_text())
    src = cfg["sources"]["wikipedia"]
    assert src["format"] == "mediawiki"
    dumps = workspace.root / "dumps"
    dumps.mkdir()
    for name in (
        "enwiki-latest-pages-articles1.xml-p1p41242.bz2",
        "enwiki-latest-pages-articles10.xml-p4045403p5399366.bz2",
        "enwiki-latest-pages-articles2.xml-p41243p151573.bz2",
        "enwiki-latest-pages-articles-multistream-index.txt.bz2",
    ):
        (dumps / name).write_bytes(b"")
    src["path"] = str(dumps / src["path"].rsplit("/", 1)[1].split("   #")[0])
    shutil.copytree(REPO / "resources" / "tokenizers", workspace.root / "resources" / "tokenizers")
    workspace.write_config(cfg)
    lists = workspace.run("-n", "data")
    assert lists.stdout.count("rule chunk:") == 3  # the multistream index is not a dump
    order = [
        read_shard_list(workspace.root / f"data/plan/wikipedia/chunk-0000{i}.list")[0].rsplit("/", 1)[1]
        for i in range(3)
    ]
    assert order == [
        "enwiki-latest-pages-articles1.xml-p1p41242.bz2",
        "enwiki-latest-pages-articles2.xml-p41243p151573.bz2",
        "enwiki-latest-pages-articles10.xml-p4045403p5399366.bz2",
    ]


@pytest.mark.slow
def test_8b_lora_chain_example_plans_the_seed_chain_on_tp4_and_tp1(workspace):
    """config/examples/llama3-8b-lora-squad-gpu.yaml: random 8B-shaped HF model -> import -> .nemo ->
    LoRA (tp 4 on 4 ranks, tp 1 on one; packed sequences of 4096) -> evaluation -> PEFT and merged exports."""
    for d in ("squad", "tokenizers"):
        shutil.copytree(REPO / "resources" / d, workspace.root / "resources" / d)
    shutil.copy(REPO / "config" / "examples" / "llama3-8b-lora-squad-gpu.yaml", workspace.config_path)
    out = workspace.run("-n", "-p", "finetunes").stdout
    stats = out.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    counts = {
        ln.split()[0]: int(ln.split()[1])
        for ln in stats.splitlines()[3:]
        if len(ln.split()) == 2 and ln.split()[1].isdigit()
    }
    assert counts == {
        "prepare_sft": 1,
        "random_hf": 1,
        "import_hf": 1,
        "evaluate_base": 1,
        "export_nemo": 1,
        "finetune": 2,
        "evaluate_finetune": 2,
        "export_peft": 2,
        "merge_lora_hf": 2,
        "compare_finetune": 2,
        "finetunes": 1,
        "total": 16,
    }
    assert "snakellm random-hf models/random/llama3-8b --preset llama3-8b --seed 0" in out
    assert "snakellm import-hf models/random/llama3-8b runs/llama3-8b" in out
    lines = [ln for ln in out.splitlines() if "snakellm finetune" in ln]
    tp4 = next(ln for ln in lines if "lora-tp4" in ln)
    tp1 = next(ln for ln in lines if "lora-tp1" in ln)
    assert "torchrun --standalone --nnodes=1 --nproc-per-node=4" in tp4 and "--tp 4" in tp4
    assert "torchrun" not in tp1 and "--tp 1" in tp1
    assert all("--packing" in ln and "--max-seq-length 4096" in ln for ln in (tp1, tp4))
    # the jobs scripts/gpu_8b_chain.sh replays where Snakemake is not installed are this dry run's
    recorded = json.loads((REPO / "scripts" / "chain8b.jobs.json").read_text())

    def commands(jobs: list[dict]) -> list[tuple]:  # Snakemake's print order and job ids may vary from run to run
        return sorted((j["rule"], j["shell"] or "", tuple(j["output"])) for j in jobs)

    assert commands(_dry_run_jobs().parse(out)) == commands(recorded), (
        "scripts/chain8b.jobs.json is stale: python scripts/dry_run_jobs.py record <snakemake -n -p output> "
        "scripts/chain8b.jobs.json"
    )


@pytest.mark.slow
def test_8b_chat_lora_example_plans_packed_conversations_on_one_gpu(workspace):
    """config/examples/llama3-8b-chat-lora-gpu.yaml: random 8B-shaped model -> import -> conversations ->
    LoRA on all four linears at sequence 4096, packed, assistant turns trained, compiled, on one GPU."""
    for d in ("sft", "tokenizers"):
        shutil.copytree(REPO / "resources" / d, workspace.root / "resources" / d)
    shutil.copy(REPO / "config" / "examples" / "llama3-8b-chat-lora-gpu.yaml", workspace.config_path)
    out = workspace.run("-n", "-p", "finetunes").stdout
    assert "snakellm prepare-sft resources/sft/botchan-chat.jsonl data/sft/chat --format messages" in out
    ft = next(ln for ln in out.splitlines() if "snakellm finetune" in ln)
    for flag in ("--packing", "--max-seq-length 4096", "--chat-template chatml", "--train-on all_assistant",
                 "--packed-attention flex", "--compile", "--tp 1", "--micro-batch-size 1", "--lora-rank 32",
                 "--lora-targets linear_qkv,linear_proj,linear_fc1,linear_fc2"):  # fmt: skip
        assert flag in ft, flag
    assert "torchrun" not in ft
    assert "snakellm evaluate" in out and "merge-hf" in out


def _dry_run_jobs():
    import importlib.util

    spec = importlib.util.spec_from_file_location("dry_run_jobs", REPO / "scripts" / "dry_run_jobs.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_jobs_replay_in_dependency_order_with_background_jobs(tmp_path, capsys):
    """scripts/dry_run_jobs.py: a job runs after those making its inputs; a background job's dependant waits."""
    m = _dry_run_jobs()
    text = """
rule b:
    input: a.txt
    output: sub/b.txt
    log: logs/b.log
    jobid: 2
Shell command: sleep 0.3; cat a.txt > sub/b.txt 2> logs/b.log
rule a:
    output: a.txt
    jobid: 1
Shell command: echo A > a.txt
rule c:
    input: sub/b.txt, a.txt
    output: c.txt
    jobid: 3
Shell command: cat sub/b.txt a.txt > c.txt
rule all:
    input: c.txt
    jobid: 0
Shell command: None
"""
    jobs = m.parse(text)
    assert [j["rule"] for j in jobs] == ["a", "b", "c", "all"]
    assert m.run(jobs, tmp_path, background=("b",)) == 0
    assert (tmp_path / "c.txt").read_text() == "A\nA\n"
    assert "Finished jobid: 2 (Rule: b)" in capsys.readouterr().out
    jobs[1]["shell"] = "exit 3"
    assert m.run(jobs, tmp_path) == 1
