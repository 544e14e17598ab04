"""`.nemo` export without NeMo: config mapping, errors before work, and the export_nemo rule.

NeMo's own loader reading these files is tests/test_nemo_compat.py. Fast tests here run in
well under a second each (the config-error one is a Snakemake dry run, ~5 s); the workflow test
shares the session's default-workflow build (a few minutes, once) and only dry-runs on top of it.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from conftest import env_with_venv, small_config

from snakellm.export import nemo
from snakellm.models import architecture, families

BIN = Path(sys.executable).parent


@pytest.mark.parametrize("preset", sorted(architecture.PRESETS))
def test_model_config_maps_back_to_the_same_architecture(preset):
    arch = architecture.resolve(preset, {"rotary_base": 500000} if "llama" in preset else {})
    why = families.get(arch["style"]).nemo_refuses(arch)
    if why:  # QK-norm, mixture of experts: refused naming the reason, nothing written
        with pytest.raises(nemo.NemoError, match="NeMo 1.x cannot represent"):
            nemo.model_config(arch, architecture.padded_vocab_size(32000, arch), {"library": "sentencepiece"})
        return
    cfg = nemo.model_config(
        arch,
        architecture.padded_vocab_size(32000, arch),
        {"library": "sentencepiece"},
        transformer_engine=nemo.transformer_engine_for(arch),
    )
    assert cfg["mcore_gpt"] is True and cfg["target"].endswith("MegatronGPTModel")
    assert cfg["transformer_engine"] is (arch["normalization"] == "RMSNorm")
    assert ("dist_ckpt_load_strictness" in cfg) is cfg["transformer_engine"]
    back = nemo.arch_from_config(yaml.safe_load(yaml.safe_dump(cfg)), "x.nemo")
    assert back == arch


@pytest.mark.parametrize(
    "change, message",
    [
        ({"mcore_gpt": False}, "not a megatron-core GPT"),
        ({"tensor_model_parallel_size": 2}, "tensor_model_parallel_size is 2"),
        ({"position_embedding_type": "alibi"}, "position_embedding_type 'alibi'"),
        ({"normalization": "layernorm1p"}, "normalization 'layernorm1p'"),
        ({"activation": "squared-relu"}, "activation 'squared-relu'"),
        ({"rotary_percentage": 0.5, "position_embedding_type": "rope"}, "rotary_percentage 0.5"),
        ({"num_layers": None}, "no 'num_layers'"),
    ],
)
def test_unsupported_nemo_configs_are_named(change, message):
    arch = architecture.resolve("tiny")
    cfg = {**nemo.model_config(arch, 128, {}), **change}
    with pytest.raises(nemo.NemoError, match=message):
        nemo.arch_from_config(cfg, "model.nemo")


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "snakellm"), *args], cwd=cwd, env=env_with_venv(), capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow  # 1.3 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
def test_export_errors_before_work(tmp_path):
    p = _cli("export-nemo", "runs/nope", "out.nemo", cwd=tmp_path)
    assert p.returncode == 2 and "runs/nope: no such checkpoint" in p.stderr
    (tmp_path / "runs/empty/checkpoints").mkdir(parents=True)
    p = _cli("export-nemo", "runs/empty", "out.nemo", cwd=tmp_path)
    assert p.returncode == 2 and "runs/empty/checkpoints: no checkpoint saved yet" in p.stderr
    assert not (tmp_path / "out.nemo").exists()
    p = _cli("import-nemo", "missing.nemo", "runs/x", cwd=tmp_path)
    assert p.returncode == 2 and "missing.nemo: no such file" in p.stderr
    (tmp_path / "bad.nemo").write_bytes(b"not a tar at all" * 100)
    p = _cli("import-nemo", "bad.nemo", "runs/x", cwd=tmp_path)
    assert p.returncode == 2 and "bad.nemo: not a .nemo (tar) file" in p.stderr
    (tmp_path / "runs/full/checkpoints").mkdir(parents=True)
    (tmp_path / "runs/full/checkpoints/latest_checkpointed_iteration.txt").write_text("5\n")
    p = _cli("import-nemo", "bad.nemo", "runs/full", cwd=tmp_path)
    assert p.returncode == 2 and "runs/full/checkpoints already exists and is not empty" in p.stderr


@pytest.mark.slow  # a Snakemake run in a subprocess: the slow tier (fast-tier budget)
def test_huggingface_tokenizer_run_is_a_config_error(workspace):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "a": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(workspace.path("tokenizer.json")))
    cfg = small_config(workspace.root)
    cfg["tokenizers"] = {"hf": {"kind": "huggingface", "tokenizer_file": "tokenizer.json", "eod": "</s>"}}
    cfg["runs"] = {"r": {"tokenizer": "hf", "train": {"steps": 1, "micro_batch_size": 1, "global_batch_size": 1}}}
    workspace.write_config(cfg)
    p = workspace.run("-n", check=False)
    assert p.returncode != 0
    assert "config key runs.r.tokenizer: a .nemo packs only gpt2-bpe or sentencepiece" in p.stdout + p.stderr
    cfg["export_nemo"] = {"enabled": False}
    workspace.write_config(cfg)
    assert workspace.run("-n").returncode == 0


@pytest.mark.slow
def test_default_workflow_ends_with_the_nemo(default_workflow):
    ws = default_workflow
    path = ws.path("runs/tiny/tiny.nemo")
    assert path.is_file()
    with tarfile.open(path, "r:") as tar:
        cfg = yaml.safe_load(tar.extractfile("./model_config.yaml").read())
        names = tar.getnames()
    assert cfg["num_layers"] == 2 and cfg["hidden_size"] == 64 and cfg["tokenizer"]["library"] == "sentencepiece"
    assert f"./{cfg['tokenizer']['model'][5:]}" in names
    assert ws.nothing_to_do("runs/tiny/tiny.nemo")
    # the export's own setting reruns the export and nothing else
    p = ws.run("-n", "--config", "export_nemo={transformer_engine: true}")
    out = p.stdout + p.stderr
    assert "rule export_nemo:" in out and "rule pretrain:" not in out
