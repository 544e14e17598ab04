"""NeMo Launcher's PEFT chain as one Snakemake target: config/examples/llama-lora-squad.yaml, end to end.

A tiny random Llama-3.1-shaped model (llama3 RoPE scaling, untied embeddings) and a tiny random
Qwen-2-shaped one (q/k/v biases, tied embeddings), both saved by transformers with a SentencePiece
``tokenizer.model`` (as tests/test_hf_families.py builds them), go through the shipped example with
only its paths and sizes changed: ``snakemake finetunes`` imports each, writes the base's ``.nemo``,
LoRA-tunes it on the shipped SQuAD subset, evaluates it, and writes the PEFT adapter and the merged
Hugging Face model. Checked against the libraries users load them with: ``peft`` on the transformers
base, and transformers on the merged directory (fp32 logits within 1e-4 of each other).

The evaluation outputs are found by globbing under ``runs/{run}/eval/``, so that a change of their
paths (one base evaluation per data set) leaves this test's assertions standing.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO, Workspace, env_with_venv
from hf_helpers import save_random_hf, train_spm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow

EXAMPLE = REPO / "config" / "examples" / "llama-lora-squad.yaml"
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
SHAPE = dict(
    vocab_size=600,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
SEQ = 128  # the fine-tune's max_seq_length: shorter than the model's (the adapter records the fine-tune's)
TEST_EXAMPLES = 8


def _hf_configs() -> dict:
    from transformers import LlamaConfig, Qwen2Config

    llama3 = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,  # short: every branch of the scaling formula is taken
        rope_theta=500000.0,
    )
    return {
        "llama31": LlamaConfig(**SHAPE, rope_parameters=llama3, tie_word_embeddings=False),
        "qwen2": Qwen2Config(
            **SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True
        ),
    }


def _chain_config(names: list[str]) -> dict:
    """The shipped example with each tiny model as an import and its fine-tune, paths and sizes made small."""
    cfg = yaml.safe_load(EXAMPLE.read_text())
    template = cfg["finetune"].pop("llama-lora-squad")
    cfg["import_hf"] = {n: {"hf_dir": f"hub/{n}"} for n in names}
    cfg["sft_data"]["squad"].update(
        path="resources/squad/squad-dev-subset.json", limit=40, split=f"24,{TEST_EXAMPLES},{TEST_EXAMPLES}"
    )
    for n in names:
        ft = copy.deepcopy(template)
        ft["run"] = n
        ft["examples"]["max_seq_length"] = SEQ
        ft["train"].update(
            steps=8, micro_batch_size=4, global_batch_size=4, lr=1.0e-2, warmup_steps=0, precision="fp32"
        )
        ft["train"].update(eval_interval=4, patience=10)
        ft["parallel"] = {"tp": 1, "threads": 1}
        ft["evaluate"] = {"tokens_to_generate": 8, "batch_size": 8}
        cfg["finetune"][f"{n}-lora-squad"] = ft
    return cfg


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Workspace:
    root = tmp_path_factory.mktemp("lora-chain")
    spm = train_spm(tmp_path_factory.mktemp("spm"))
    for name, config in _hf_configs().items():
        save_random_hf(config, root / "hub" / name, spm, {"eos_token": "</s>", "chat_template": TEMPLATE})
    shutil.copytree(REPO / "resources" / "squad", root / "resources" / "squad")
    ws = Workspace(root)
    ws.write_config(_chain_config(list(_hf_configs())))
    ws.run("finetunes", timeout=900)
    return ws


def _nemo_config(path: Path) -> dict:
    with tarfile.open(path) as tar:
        member = tar.extractfile("./model_config.yaml")
        assert member is not None
        return yaml.safe_load(member.read())


def test_the_example_is_the_chain_and_nothing_is_left_to_do(chain: Workspace):
    for name in _hf_configs():
        assert json.loads(chain.path(f"runs/{name}/import_summary.json").read_text())["arch"]["style"] in (
            "llama3",
            "qwen2",
        )
    assert chain.nothing_to_do("finetunes")


@pytest.mark.parametrize("name", ["llama31", "qwen2"])
def test_nemo_of_the_base(chain: Workspace, name: str):
    cfg = _nemo_config(chain.path(f"runs/{name}/{name}.nemo"))
    assert cfg["mcore_gpt"] is True and cfg["num_layers"] == 2 and cfg["hidden_size"] == 64
    assert cfg["num_query_groups"] == 2 and cfg["ffn_hidden_size"] == 96
    assert cfg["tokenizer"]["library"] == "sentencepiece"
    if name == "llama31":
        assert cfg["scale_positional_embedding"] is True and cfg["rotary_base"] == 500000
        assert cfg["share_embeddings_and_output_weights"] is False
    else:
        assert cfg["qkv_bias"] is True and cfg["bias"] is False and cfg["rotary_base"] == 1000000
        assert cfg["share_embeddings_and_output_weights"] is True


@pytest.mark.parametrize("name", ["llama31", "qwen2"])
def test_finetune_trained_and_was_evaluated(chain: Workspace, name: str):
    ft = f"{name}-lora-squad"
    summary = json.loads(chain.path(f"runs/{name}/finetune/{ft}/finetune_summary.json").read_text())
    assert summary["method"] == "lora" and summary["final_loss"] < summary["first_loss"]
    tests = chain.path("data/sft/squad/test.jsonl").read_text().splitlines()
    assert len(tests) == TEST_EXAMPLES
    metrics = sorted(chain.path(f"runs/{name}/eval").rglob("metrics.json"))
    assert any(ft in str(m) for m in metrics), metrics  # the tuned model's (the base's may live elsewhere)
    for m in metrics:
        values = json.loads(m.read_text())
        esm = [k for k in values if k.endswith("exact_string_match")]
        assert esm and all(0.0 <= values[k] <= 1.0 for k in esm), (m, values)
    predictions = sorted(chain.path(f"runs/{name}/eval").rglob("predictions*.jsonl"))
    assert any(ft in str(p) for p in predictions), predictions
    for p in predictions:
        rows = [json.loads(line) for line in p.read_text().splitlines()]
        assert len(rows) == TEST_EXAMPLES, p


@pytest.mark.parametrize("name", ["llama31", "qwen2"])
def test_peft_adapter_and_merged_model_agree_with_transformers(chain: Workspace, name: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    d = chain.path(f"runs/{name}/finetune/{name}-lora-squad")
    base = AutoModelForCausalLM.from_pretrained(chain.path(f"hub/{name}"), dtype=torch.float32).eval()
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = base(ids).logits
        tuned = PeftModel.from_pretrained(base, d / "hf_peft").eval()
        with_adapter = tuned(ids).logits
        merged_model = AutoModelForCausalLM.from_pretrained(d / "hf_merged", dtype=torch.float32).eval()
        merged = merged_model(ids).logits
    assert type(merged_model).__name__ == type(base).__name__
    assert (with_adapter - before).abs().max().item() > 1e-3  # the adapter was trained: it moves the logits
    assert (merged - with_adapter).abs().max().item() < 1e-4
    # the base's context, not the fine-tune's shorter max_seq_length
    assert json.loads((d / "hf_merged" / "config.json").read_text())["max_position_embeddings"] == 256
    tok = json.loads((d / "hf_merged" / "tokenizer_config.json").read_text())
    assert tok["chat_template"] == TEMPLATE  # the base's chat template travels to the merged model


def test_merge_refuses_an_adapter_of_another_base(chain: Workspace):
    """Both tiny models have the same shapes: only the recorded architecture tells the adapters apart."""
    p = subprocess.run(
        [sys.executable, "-m", "snakellm.cli", "lora", "merge-hf", "--base", "runs/llama31"]
        + ["--adapter", "runs/qwen2/finetune/qwen2-lora-squad/adapter", "--out", "wrong"],
        cwd=chain.root,
        env=env_with_venv(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2 and "trained on another model than runs/llama31" in p.stderr, p.stderr
    assert "style 'qwen2' != 'llama3'" in p.stderr and not chain.path("wrong").exists()


def test_a_tokenizer_json_base_runs_the_chain_without_a_nemo_and_says_so(chain: Workspace):
    """NeMo 1.x packs no tokenizer.json (Llama 3's, Qwen 2's own): the chain plans without the .nemo, with a note."""
    hub = chain.path("hub/qwen2-tokjson")
    hub.mkdir()
    shutil.copy(chain.path("hub/qwen2/config.json"), hub / "config.json")
    (hub / "tokenizer.json").write_text("{}")
    ws = Workspace(chain.root)
    ws.config_path = chain.root / "config-tokjson.yaml"
    cfg = _chain_config(["qwen2"])
    cfg["import_hf"] = {"qwen2": {"hf_dir": "hub/qwen2-tokjson"}}
    ws.write_config(cfg)
    out = ws.run("-n", "finetunes")
    text = out.stdout + out.stderr
    assert "import_hf.qwen2: no .nemo: its tokenizer is a Hugging Face tokenizer.json" in text
    stats = out.stdout.split("Job stats:", 1)[1]
    jobs = {ln.split()[0] for ln in stats.splitlines() if len(ln.split()) == 2 and ln.split()[1].isdigit()}
    assert {"import_hf", "finetune", "export_peft", "merge_lora_hf", "finetunes"} <= jobs and "export_nemo" not in jobs
