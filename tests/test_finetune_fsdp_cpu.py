"""Full SFT with its weights, gradients and optimizer states sharded (``snakellm finetune --fsdp``, FSDP2).

Real `snakellm finetune --method full` on a tiny Llama base with random weights, fp32 on the CPU: one
process without FSDP, then 2 gloo ranks with it (torchrun), the same 6 steps at micro batch 1 (so both
average the same per-example losses): the same loss at every step (1e-5), gradient norms and validation
losses (15 examples: one rank runs an unscored one, to gather the weights as often as the other), and the
same final ``model/`` artifact, tensor for tensor in the same checkpoint layout (the exports read it chunk
by chunk; they put the FSDP run's training checkpoints, stored as each rank's blocks, together too). A
resume of the FSDP run from its step-3 checkpoint, with full activation recomputation on top, continues
with the uninterrupted run's losses exactly. LoRA and p-tuning with ``fsdp`` are refused, at
the config check and at the step, naming the setting.

The runs are one module fixture (three launches) and the resume one more: marked slow (~35 s together on
2 cores); the refusals take milliseconds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, env_with_venv

BIN = Path(sys.executable).parent
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "--no-python"]
FT = ["finetune", "--base", "base", "--data-dir", "sft", "--method", "full", "--steps", "6", "--lr", "1e-3"]
FT += ["--micro-batch-size", "1", "--global-batch-size", "4", "--max-seq-length", "128", "--eval-interval", "3"]
FT += ["--keep-last", "2", "--select", "last", "--device", "cpu", "--no-progress"]

# a tiny-llama base of random weights (what `snakellm finetune --base` reads) and 16 SFT examples, 15 of them
# for validation (2 ranks: 8 and 7, the second filled in with an unscored example)
MAKE = """
import json, sys, torch
from pathlib import Path
from snakellm import models
from snakellm.finetune import runtime
from snakellm.finetune.artifacts import save_model
from snakellm.models.build import build_model
if __name__ == "__main__":
    repo = Path(sys.argv[1])
    runtime.start("cpu", 1)
    arch = models.resolve("tiny-llama", {})
    vocab = models.padded_vocab_size(50257, arch)
    torch.manual_seed(0)
    gpt, _ = build_model(arch, vocab, fused_loss="eager", use_te=False)
    files = {"vocab_file": str(repo / "resources/tokenizers/gpt2/vocab.json"),
             "merges_file": str(repo / "resources/tokenizers/gpt2/merges.txt")}
    tok = {"kind": "gpt2-bpe", "name": "gpt2", "vocab_size": 50257, "eod_id": 50256,
           "eod_token": "<|endoftext|>", "files": files}
    save_model(gpt, Path("base"), arch, vocab, tok)
    lines = (repo / "resources/corpus/botchan/botchan.jsonl").read_text().splitlines()
    recs = [{"input": json.loads(line)["text"][:300], "output": f" the answer is {i}"} for i, line in enumerate(lines[:16])]
    Path("sft").mkdir()
    for split, n in (("train", 16), ("validation", 15)):
        Path("sft", f"{split}.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in recs[:n]))
    runtime.stop()
"""


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env_with_venv(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def finetune(root: Path, out: str, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    return _run([*(TORCHRUN if nproc > 1 else []), str(BIN / "snakellm"), *FT, "--out-dir", out, *extra], root)


def records(run: Path) -> dict[int, dict]:
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in recs if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, str]:
    """The base and data, the run without FSDP (one process) and with it (2 ranks): (root, FSDP's stderr)."""
    root = tmp_path_factory.mktemp("ft-fsdp")
    _run([sys.executable, "-c", MAKE, str(REPO)], root)
    finetune(root, "one", 1)
    return root, finetune(root, "fsdp", 2, "--fsdp").stderr


# three launches of `snakellm finetune` and the base's (~25 s on 2 cores)
@pytest.mark.slow
def test_fsdp_full_sft_matches_one_process_and_writes_the_same_model(runs):
    from torch.distributed.checkpoint import FileSystemReader

    from snakellm.export.stream import read_groups
    from snakellm.models.loading import describe_run

    root, stderr = runs
    assert "sharded over 2 ranks (FSDP2)" in stderr and "FSDP: rank 0 holds " in stderr
    assert "returned a view tensor" not in stderr  # quiet stderr
    one, fsdp = records(root / "one"), records(root / "fsdp")
    assert one.keys() == fsdp.keys() == set(range(1, 7))
    for step in one:
        assert abs(fsdp[step]["loss"] - one[step]["loss"]) <= 1e-5 * one[step]["loss"], (step, one, fsdp)
        assert abs(fsdp[step]["grad_norm"] / one[step]["grad_norm"] - 1) <= 5e-5, (step, one, fsdp)
    val = {
        run: [
            (r["step"], r["val_loss"])
            for r in map(json.loads, (root / run / "metrics.jsonl").open())
            if "val_loss" in r
        ]
        for run in ("one", "fsdp")
    }
    assert [s for s, _ in val["one"]] == [s for s, _ in val["fsdp"]] == [3, 6]
    for (_, v1), (_, v2) in zip(val["one"], val["fsdp"]):
        assert abs(v2 - v1) <= 1e-5 * v1, val
    assert one[6]["loss"] < one[1]["loss"]
    summary = json.loads((root / "fsdp" / "finetune_summary.json").read_text())
    assert summary["trainable_parameters"] == summary["total_parameters"]

    def model(run: str) -> tuple[dict, dict]:
        info = describe_run(str(root / run / "model"))
        tensors = {}
        for g in read_groups(info["checkpoint_dir"], info["iteration"], info["arch"], info["padded_vocab_size"]):
            tensors.update(g)
        md = FileSystemReader(str(root / run / "model/checkpoints/iter_0000000")).read_metadata()
        layout = {
            k: [(c.offsets, c.sizes) for c in v.chunks]
            for k, v in md.state_dict_metadata.items()
            if hasattr(v, "chunks")
        }
        return tensors, layout

    (a, la), (b, lb) = model("one"), model("fsdp")
    assert la == lb  # the checkpoint's tensors in the same chunks: an unsharded run's layout
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert (a[k] - b[k]).abs().max().item() <= 1e-5, k
    # the training checkpoints hold FSDP's row slices as blocks; the exports' reader puts each layer together
    info = describe_run(str(root / "one" / "model"))
    for run, want in (("fsdp", a), ("one", a)):
        groups = read_groups(root / run / "checkpoints", 6, info["arch"], info["padded_vocab_size"])
        got = {k: v for g in groups for k, v in g.items()}
        assert got.keys() == want.keys() and all((got[k] - want[k]).abs().max().item() <= 1e-5 for k in got)


# one 2-rank launch (~10 s)
@pytest.mark.slow
def test_fsdp_full_sft_resumes_exactly_with_recomputation(runs):
    root, _ = runs
    shutil.copytree(root / "fsdp", root / "fsdp-resumed")
    (root / "fsdp-resumed" / "checkpoints/latest_checkpointed_iteration.txt").write_text("3\n")
    proc = finetune(root, "fsdp-resumed", 2, "--fsdp", "--recompute", "full")
    assert "resumed from fsdp-resumed/checkpoints/iter_0000003" in proc.stderr
    resumed, fsdp = records(root / "fsdp-resumed"), records(root / "fsdp")
    assert {s: r["loss"] for s, r in resumed.items()} == {s: r["loss"] for s, r in fsdp.items()}


@pytest.mark.parametrize("method", ["lora", "ptuning"])
def test_fsdp_with_an_adapter_method_is_refused_at_the_step(tmp_path, capsys, method):
    from snakellm.steps.finetune import main

    argv = ["--base", str(tmp_path / "nothing"), "--data-dir", str(tmp_path), "--out-dir", str(tmp_path / "ft")]
    assert main([*argv, "--method", method, "--steps", "2", "--fsdp"]) == 2
    err = capsys.readouterr().err
    assert (
        f"snakellm finetune: error: --fsdp shards every weight of a full fine-tune: it needs --method full (got {method}"
        in err
    )
    assert "drop --fsdp" in err


def test_fsdp_with_an_adapter_method_is_refused_at_the_config_check(tmp_path):
    from snakellm.config.checks import check_finetunes
    from snakellm.errors import ConfigError

    ft = {"run": "b", "data": "d", "method": "lora", "train": {"global_batch_size": 8, "micro_batch_size": 4}}
    config = {"import_hf": {"b": {}}, "sft_data": {"d": {"path": "x.json"}}, "finetune": {"t": ft}}
    check_finetunes(config)
    ft["parallel"] = {"fsdp": True}
    with pytest.raises(
        ConfigError,
        match=r"config key finetune.t.parallel.fsdp: FSDP shards every weight of a full "
        r"fine-tune: it needs method full \(got lora, .*drop fsdp\)",
    ):
        check_finetunes(config)
    ft["method"] = "full"
    check_finetunes(config)
