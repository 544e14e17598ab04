"""Llama 3.x, Qwen2, Qwen3 and Mistral checkpoints saved by transformers: import, generate and export, against transformers.

Each tiny random model carries its family's features: Llama 3.1 RoPE scaling (an original context
short enough that every branch of the formula is taken) with untied and tied (3.2) embeddings,
Qwen2's q/k/v-only biases (perturbed away from zero) with tied and untied embeddings and its RoPE
base, Qwen3's QK-norm with a head size other than d / heads, Mistral's sliding window (null, and shorter than max_position_embeddings). Checked: fp32 logits
within 1e-4 of transformers', identical greedy continuations (our KV-cached decoder against
``generate``), an export that transformers loads into the same class with identical tensors and
logits, and the chat template carried from import to export.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_helpers import save_random_hf, train_spm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
)
SHAPE = dict(
    vocab_size=600,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama3.1-untied": (
            LlamaConfig(**SHAPE, rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0}, tie_word_embeddings=False),
            "LlamaForCausalLM",
        ),
        "llama3.2-tied": (
            LlamaConfig(
                **SHAPE,
                rope_parameters={**LLAMA3_ROPE, "factor": 32.0, "rope_theta": 500000.0},
                tie_word_embeddings=True,
            ),
            "LlamaForCausalLM",
        ),
        "qwen2-tied": (
            Qwen2Config(
                **SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True
            ),
            "Qwen2ForCausalLM",
        ),
        "qwen2-untied": (
            Qwen2Config(
                **SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False
            ),
            "Qwen2ForCausalLM",
        ),
        # QK-norm, and heads of 32 at d=64 with 4 heads (attention 128 wide): head_dim independent of the width
        "qwen3-tied": (
            Qwen3Config(
                **SHAPE,
                head_dim=32,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                tie_word_embeddings=True,
            ),
            "Qwen3ForCausalLM",
        ),
        "qwen3-untied": (
            Qwen3Config(
                **SHAPE,
                head_dim=8,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                tie_word_embeddings=False,
            ),
            "Qwen3ForCausalLM",
        ),
        "mistral-window": (MistralConfig(**SHAPE, sliding_window=64, head_dim=16), "MistralForCausalLM"),
        "mistral-no-window": (MistralConfig(**SHAPE, sliding_window=None, head_dim=16), "MistralForCausalLM"),
    }


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    return train_spm(tmp_path_factory.mktemp("spm"))


def _save(config, src: Path, spm: Path):
    return save_random_hf(config, src, spm, {"eos_token": "</s>", "chat_template": TEMPLATE})


@pytest.mark.slow  # transformers' model and generate for each family; the fast tier's 90 s has no room
@pytest.mark.parametrize("case", list(_configs()))
def test_family_import_generate_export_against_transformers(case, tmp_path, spm_model):
    from transformers import AutoModelForCausalLM

    from snakellm.export.hf import export_hf, import_hf
    from snakellm.models.loading import load
    from snakellm.serve.generate import Generator, SamplingParams, load_tokenizer

    config, exported_class = _configs()[case]
    hf = _save(config, tmp_path / "src", spm_model)
    summary = import_hf(tmp_path / "src", tmp_path / "run")
    arch = summary["arch"]
    loaded = load(tmp_path / "run")
    V = config.vocab_size
    n = min(arch["seq_length"], 40)
    ids = torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(n).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        ref = hf(ids).logits
        ours = loaded.model(ids, pos, None)[..., :V]
    assert (ours - ref).abs().max().item() < 1e-4

    gen = Generator(loaded.model, loaded.arch, load_tokenizer(loaded.tokenizer), V)
    prompt = ids[0, :8].tolist()
    out = gen.generate([prompt], SamplingParams(max_new_tokens=20, greedy=True, stop_at_eod=False))[0]
    x = torch.tensor([prompt])
    with torch.no_grad():
        y = hf.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert y[0, 8:].tolist() == out.ids

    back = export_hf(loaded, tmp_path / "back")
    hf2 = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    assert type(hf2).__name__ == exported_class
    a, b = hf.state_dict(), hf2.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    with torch.no_grad():
        assert torch.equal(hf2(ids).logits, ref)
    assert json.loads((back / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    from transformers import AutoTokenizer

    at = AutoTokenizer.from_pretrained(back)
    text = at.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|user|>hi\n"


def test_family_features_in_the_architecture():
    from snakellm.export.hf import arch_from_hf

    cfgs = _configs()
    llama = arch_from_hf(cfgs["llama3.1-untied"][0].to_dict())
    assert (llama["rope_scaling_factor"], llama["rope_low_freq_factor"], llama["rope_high_freq_factor"]) == (8, 1, 4)
    assert llama["rope_original_max_positions"] == 16 and llama["rotary_base"] == 500000
    assert arch_from_hf(cfgs["llama3.2-tied"][0].to_dict())["tie_embeddings"] is True
    qwen = arch_from_hf(cfgs["qwen2-tied"][0].to_dict())
    assert (qwen["qkv_bias"], qwen["bias"], qwen["rotary_base"]) == (True, False, 1000000)
    mistral = arch_from_hf(cfgs["mistral-window"][0].to_dict())
    assert (mistral["style"], mistral["sliding_window"], mistral["seq_length"]) == ("mistral", 64, 64)
    assert (llama["style"], qwen["style"]) == ("llama3", "qwen2")
    qwen3 = arch_from_hf(cfgs["qwen3-tied"][0].to_dict())
    assert (qwen3["style"], qwen3["kv_channels"], qwen3["qk_norm"], qwen3["bias"]) == ("qwen3", 32, True, False)


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope scaling .*yarn"),
        (dict(rope_scaling={**LLAMA3_ROPE, "attention_factor": 2.0}), "attention_factor=2.0"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "llama3 needs high_freq_factor"),
        (dict(rope_scaling=LLAMA3_ROPE, partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(model_type="mistral", sliding_window=32), "sliding_window 32 < max_position_embeddings 64"),
        (dict(head_dim=32), "head_dim 32"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16), "use_sliding_window"),
        (dict(model_type="qwen3", attention_bias=True), "attention_bias true"),
        (dict(model_type="qwen3", use_sliding_window=True, sliding_window=16), "use_sliding_window"),
        (dict(model_type="phi3"), "model_type 'phi3'"),
    ],
)
def test_import_refuses_with_key_and_value(over, match):
    from snakellm.export.hf import ExportError, arch_from_hf

    cfg = {"model_type": "llama", **SHAPE, **over}
    with pytest.raises(ExportError, match=match):
        arch_from_hf(cfg)


@pytest.mark.parametrize(
    "preset, hf_cls, params, vocab",
    [
        # the published parameter counts of Llama 3.2 1B and Qwen2.5 0.5B
        ("llama3-1b", "LlamaConfig", 1_235_814_400, 128256),
        ("qwen2.5-0.5b", "Qwen2Config", 494_032_768, 151936),
    ],
)
def test_presets_are_the_real_shapes(preset, hf_cls, params, vocab):
    """The presets equal what import makes of the real models' config.json (its sequence length aside)."""
    from snakellm.export.hf import arch_from_hf
    from snakellm.models import param_count, resolve

    shape = {
        "llama3-1b": dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
        "qwen2.5-0.5b": dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    }[preset]
    config = getattr(transformers, hf_cls)(vocab_size=vocab, **shape).to_dict()
    ours = resolve(preset)
    imported = arch_from_hf(config)
    assert {**imported, "seq_length": ours["seq_length"]} == ours
    assert param_count(ours, vocab) == params


@pytest.mark.parametrize("preset, hf_cls", [("qwen3-0.6b", "Qwen3Config"), ("qwen3-8b", "Qwen3Config")])
def test_qwen3_presets_count_what_transformers_builds(preset, hf_cls):
    """The Qwen3 presets' parameter counts (QK-norm, heads of 128 wider than d / heads at 0.6B) are those of
    transformers' Qwen3ForCausalLM of the exported config, built on the meta device."""
    from snakellm.models import families, param_count, resolve

    arch = resolve(preset)
    fam = families.get("qwen3")
    config = getattr(transformers, hf_cls)(**{**fam.hf_config(arch), "vocab_size": 151936})
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    assert param_count(arch, 151936) == sum(p.numel() for p in hf.parameters())
    assert fam.arch_from_hf(config.to_dict(), "config.json")["kv_channels"] == 128


@pytest.mark.parametrize("preset, over", [("tiny", {}), ("tiny-llama", {"style": "qwen2"}), ("tiny-qwen3", {})])
def test_streaming_export_of_a_trained_checkpoint_equals_the_in_memory_one(preset, over, tmp_path, spm_model):
    """``snakellm export-hf`` reads a checkpoint megatron-core's own writer saved one layer at a time."""
    from hf_helpers import random_checkpoint, tokenizer_block

    from snakellm.export.hf import export_hf, export_hf_from_checkpoint
    from snakellm.export.stream import SafetensorsReader
    from snakellm.models.loading import describe_run, load

    tok = tokenizer_block("sentencepiece", spm_model)
    random_checkpoint(tmp_path / "run", over, tok, preset=preset)
    whole = export_hf(load(tmp_path / "run"), tmp_path / "whole", max_shard_size="20KB")
    streamed = export_hf_from_checkpoint(describe_run(tmp_path / "run"), tmp_path / "streamed", max_shard_size="20KB")
    a, b = SafetensorsReader(whole), SafetensorsReader(streamed)
    assert len({e[0] for e in b.entries.values()}) > 3  # several shards
    assert set(a.entries) == set(b.entries)
    for name in a.entries:
        assert torch.equal(a[name], b[name]), name
    assert json.loads((whole / "config.json").read_text()) == json.loads((streamed / "config.json").read_text())
