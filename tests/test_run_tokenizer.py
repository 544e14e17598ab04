"""A run carries its tokenizer (snakellm.io.run_tokenizer): copied at training time, read from there by every step.

The unit tests check the copy, its manifest and checksums, the error for a run
trained before runs carried their tokenizer, and the fallback to absolute
recorded paths. The end-to-end test runs ``snakellm generate`` and
``snakellm export-hf`` on the default workflow's tiny run (SentencePiece,
trained with a relative ``tokenizers/spm2k/tokenizer.model``) by its absolute
path from another working directory (/tmp), and checks the output equals the
one made from the workflow directory.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import BIN, Workspace, env_with_venv

from snakellm.io import run_tokenizer


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_carry_copies_the_files_and_resolve_reads_only_the_copy(tmp_path, monkeypatch):
    src = tmp_path / "work" / "tokenizers" / "t"
    src.mkdir(parents=True)
    (src / "vocab.json").write_text('{"a": 0}')
    (src / "merges.txt").write_text("#version: 0.2\n")
    monkeypatch.chdir(tmp_path / "work")  # the blend's paths are relative to the workflow directory
    block = {
        "kind": "gpt2-bpe",
        "vocab_size": 1,
        "eod_id": 0,
        "files": {"vocab_file": "tokenizers/t/vocab.json", "merges_file": "tokenizers/t/merges.txt"},
        "nemo": {"vocab_file": "tokenizers/t/vocab.json"},
    }
    run = tmp_path / "work" / "runs" / "r"
    carried = run_tokenizer.carry(block, run)
    manifest = json.loads((run / "tokenizer" / "manifest.json").read_text())
    assert manifest["kind"] == "gpt2-bpe"
    assert manifest["files"] == {"merges_file": "merges.txt", "vocab_file": "vocab.json"}
    assert manifest["sha256"] == {"vocab.json": _sha(src / "vocab.json"), "merges.txt": _sha(src / "merges.txt")}
    assert "nemo" not in manifest["block"]  # derived from the original paths: not carried
    assert carried["files"]["vocab_file"] == str((run / "tokenizer" / "vocab.json").resolve())

    monkeypatch.chdir("/")
    (src / "vocab.json").unlink()  # the original is gone: the run does not need it
    got = run_tokenizer.resolve(run, {"files": {"vocab_file": "tokenizers/t/vocab.json"}})
    assert got["files"] == {
        "vocab_file": str((run / "tokenizer" / "vocab.json").resolve()),
        "merges_file": str((run / "tokenizer" / "merges.txt").resolve()),
    }
    assert got["vocab_size"] == 1 and got["kind"] == "gpt2-bpe"

    (run / "tokenizer" / "merges.txt").write_text("changed")
    with pytest.raises(run_tokenizer.RunTokenizerError, match="differs from the file the run was trained with"):
        run_tokenizer.resolve(run, None)


def test_a_run_without_its_tokenizer_says_what_to_do(tmp_path):
    model = tmp_path / "tokenizer.model"
    model.write_bytes(b"x")
    recorded = {"kind": "sentencepiece", "files": {"model_file": str(model)}}
    # an older run whose recorded path is absolute and still there: used as recorded
    assert run_tokenizer.resolve(tmp_path / "old", recorded) == recorded
    with pytest.raises(run_tokenizer.RunTokenizerError) as e:
        run_tokenizer.resolve(tmp_path / "old", {"kind": "sentencepiece", "files": {"model_file": "tok/x.model"}})
    assert "carries no tokenizer" in str(e.value) and "python -m snakellm.io.run_tokenizer" in str(e.value)
    assert "tok/x.model" in str(e.value)
    # the suggested command gives the run its tokenizer
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "x.model").write_bytes(b"m")
    blend = tmp_path / "blend.json"
    blend.write_text(
        json.dumps({"tokenizer": {"kind": "sentencepiece", "files": {"model_file": str(tmp_path / "tok/x.model")}}})
    )
    assert run_tokenizer.main([str(tmp_path / "old"), str(blend)]) == 0
    assert run_tokenizer.resolve(tmp_path / "old", None)["files"]["model_file"].endswith("old/tokenizer/x.model")


def _snakellm(*args: str, cwd: str | Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(BIN / "snakellm"), *args], cwd=cwd, env=env_with_venv(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"snakellm {args[0]} in {cwd} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_generate_and_export_on_an_absolute_run_path_from_another_directory(default_workflow: Workspace):
    root = default_workflow.root
    run = (root / "runs" / "tiny").resolve()
    manifest = json.loads((run / "tokenizer" / "manifest.json").read_text())
    assert manifest["kind"] == "sentencepiece" and manifest["files"] == {"model_file": "tokenizer.model"}
    assert manifest["sha256"]["tokenizer.model"] == _sha(root / "tokenizers" / "spm2k" / "tokenizer.model")

    args = ["generate", str(run), "--prompt", "The old man", "--max-new-tokens", "12", "--greedy", "--device", "cpu"]
    here = _snakellm(*args, cwd=root)
    with tempfile.TemporaryDirectory(dir="/tmp") as elsewhere:
        there = _snakellm(*args, cwd=elsewhere)
        out = Path(elsewhere) / "hf"
        _snakellm("export-hf", str(run), str(out), cwd=elsewhere)
        assert (out / "tokenizer.model").read_bytes() == (run / "tokenizer" / "tokenizer.model").read_bytes()
        assert json.loads((out / "config.json").read_text())["vocab_size"] == 2000
    rec = json.loads(there.stdout.strip().splitlines()[-1])
    assert rec["prompt"] == "The old man" and rec["completion"].strip()
    assert rec["tokens"] == 12 or rec["finish_reason"] == "eod"
    assert there.stdout == here.stdout  # the same tokenizer and weights, whatever the working directory
