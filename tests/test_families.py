"""Every registered model family: presets build, the weight table round-trips, the config table round-trips.

A new family (docs/extending.md) is covered here by being registered: its presets are built with
megatron-core (on the meta device: no memory, seconds), every tensor of each preset is named by the
family's weight table, the table's import map is the inverse of its export map on random tensors,
the Hugging Face names and shapes are exactly those of the transformers class built from the
exported config.json, and import(export(config)) gives the architecture back.
"""

from __future__ import annotations

import pytest

from snakellm.models import families
from snakellm.models.architecture import PRESETS, padded_vocab_size, resolve

torch = pytest.importorskip("torch")

VOCAB = 300  # the tokenizer's: padded to 384, so the vocab rows' trimming and zero-padding show


def _variants(fam: families.Family) -> list[dict]:
    """Small architectures of the family: its defaults, with/without biases, tied/untied, GQA where allowed."""
    base = {"style": fam.name, "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16}
    out = []
    for bias in (False, True):
        for tie in (False, True):
            for groups in (4, 2):
                arch = resolve(None, {**base, "bias": bias, "tie_embeddings": tie, "num_query_groups": groups})
                if fam.computes(arch) is None:
                    out.append(arch)
    return out


CASES = [(f.name, i) for f in families.FAMILIES.values() for i in range(len(_variants(f)))]


@pytest.fixture(scope="module")
def parallel():
    from snakellm.launch.runtime import ensure_single_process, shutdown

    ensure_single_process("cpu")
    yield
    shutdown()


def _megatron_tensors(arch: dict, padded: int, meta: bool = False) -> dict:
    from snakellm.export.hf import megatron_tensors
    from snakellm.models.build import build_model

    if meta:
        with torch.device("meta"):
            model, _ = build_model(arch, padded, fused_loss="eager", use_te=False)
    else:
        torch.manual_seed(0)
        model, _ = build_model(arch, padded, fused_loss="eager", use_te=False)
    return megatron_tensors(model)


def test_registry_lookups():
    assert list(families.FAMILIES)[:2] == ["gpt2", "llama"]  # registered in module-name order
    for fam in families.FAMILIES.values():
        assert families.get(fam.name) is fam
        arch = resolve(None, {"style": fam.name, **_small()})
        # a family sharing its model_type with another (Llama 3.x) is found for the configs it claims
        config = fam.hf_config(arch) if fam.hf_claims is not None else None
        assert families.by_model_type(fam.hf_model_type, config=config) is fam
        assert families.for_arch(arch) is fam
        assert set(fam.presets) <= set(PRESETS) and all(PRESETS[p]["style"] == fam.name for p in fam.presets)
    with pytest.raises(families.FamilyError, match="unknown model style 'nope'"):
        families.get("nope")
    with pytest.raises(families.FamilyError, match="model_type 'nope'"):
        families.by_model_type("nope")
    # a gpt2-style model given every llama feature is what LlamaForCausalLM computes
    llama_like = resolve("tiny", {"position_embedding": "rope", "normalization": "RMSNorm", "activation": "swiglu"})
    assert families.for_arch(llama_like).name == "llama"


def _small() -> dict:
    return {"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 8}


# Qwen3-30B-A3B's 128 experts a layer take ~10 s to build: the slow tier (fast-tier budget)
@pytest.mark.parametrize(
    "preset", [pytest.param(p, marks=pytest.mark.slow) if p == "qwen3-30b-a3b" else p for p in PRESETS]
)
def test_every_preset_builds_and_every_tensor_is_in_its_table(preset, parallel):
    from snakellm.models.counts import param_count

    arch = resolve(preset)
    fam = families.get(arch["style"])
    padded = padded_vocab_size(50257, arch)
    m = _megatron_tensors(arch, padded, meta=True)
    assert sum(t.numel() for t in m.values()) == param_count(arch, padded)
    hf = fam.to_hf(arch, m, 50257)  # meta tensors: names and shapes only
    back = fam.from_hf(arch, hf, padded)
    assert set(back) == set(m), set(back) ^ set(m)
    assert all(back[k].shape == m[k].shape for k in m)


@pytest.mark.parametrize(("style", "i"), CASES)
def test_weight_table_round_trips_and_names_what_transformers_builds(style, i, parallel):
    import transformers

    fam = families.get(style)
    arch = _variants(fam)[i]
    padded = padded_vocab_size(VOCAB, arch)
    m = _megatron_tensors(arch, padded)
    with torch.no_grad():
        for t in m.values():
            t.normal_()  # norms and biases too: a wrong row mapping cannot hide behind ones and zeros
    hf = fam.to_hf(arch, m, VOCAB)
    back = fam.from_hf(arch, hf, padded)
    assert set(back) == set(m)
    for k, t in m.items():
        want = t.clone()
        if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            want[VOCAB:] = 0  # rows past the tokenizer's vocabulary are not exported, and come back as zeros
        assert torch.equal(back[k], want), k
    # the names and shapes are transformers' own for the exported config
    config = {**fam.hf_config(arch), "vocab_size": VOCAB}
    cls = getattr(transformers, fam.hf_architecture)
    built = cls(transformers.AutoConfig.for_model(**config))
    ref = built.state_dict()
    if arch.get("num_experts"):  # transformers fuses a layer's experts in memory and saves them one by one
        import tempfile

        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory() as d:
            built.save_pretrained(d)
            ref = load_file(f"{d}/model.safetensors")
        ref.setdefault("lm_head.weight", built.state_dict()["lm_head.weight"])
    tied = set(ref) - set(hf)
    assert tied <= ({"lm_head.weight"} if arch["tie_embeddings"] else set()), tied
    assert {k: tuple(t.shape) for k, t in hf.items()} == {k: tuple(ref[k].shape) for k in hf}
    # and the exported config reads back as the same architecture (a class that always has biases,
    # GPT-2's, reads a bias-free model back with its zero biases)
    arch_back = resolve(None, fam.arch_from_hf(config, "config.json"))
    assert arch_back == (dict(arch, bias=True) if any(w.hf_always for w in fam.weights) else arch)


@pytest.mark.parametrize("style", list(families.FAMILIES))
def test_peft_names_come_from_the_weight_table(style):
    fam = families.get(style)
    hf_names = {t.rsplit(".", 1)[0] for w in fam.weights for t in w.theirs}
    linears = ["self_attention.linear_qkv", "self_attention.linear_proj"]
    if not fam.defaults.get("num_experts"):  # a MoE layer's MLP is its router and experts (LoRA: attention)
        linears += ["mlp.linear_fc1", "mlp.linear_fc2"]
    for linear in linears:
        mods, rows = fam.peft_modules(f"decoder.layers.3.{linear}")
        assert mods and all(".3." in m and m.replace(".3.", ".{i}.") in hf_names for m in mods), mods
        assert rows in ("same", "qkv", "qkv_cat", "gate_up")
    assert fam.hf_module("decoder.final_layernorm") in hf_names
    with pytest.raises(families.FamilyError):
        fam.peft_modules("decoder.layers.x.mlp.linear_fc1")


def test_a_family_sharing_a_model_type_claims_its_own_configs(monkeypatch):
    """Llama 3.x is model_type llama too: a family with ``hf_claims`` takes the configs it claims, the plain
    llama family the rest, and each architecture exports through its own style first."""
    import dataclasses

    llama = families.get("llama")
    llama3 = dataclasses.replace(
        llama,
        name="llama3x",
        presets={},
        hf_claims=lambda c: (c.get("rope_scaling") or {}).get("rope_type") == "llama3",
    )
    monkeypatch.delitem(families.FAMILIES, "llama3")  # the real Llama 3.x family claims the same configs
    monkeypatch.setitem(families.FAMILIES, "llama3x", llama3)
    scaled = {"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert families.by_model_type("llama", "config.json", scaled) is llama3
    assert families.by_model_type("llama", "config.json", {"model_type": "llama"}) is llama
    arch = resolve("tiny-llama")
    assert families.for_arch(arch) is llama and families.for_arch({**arch, "style": "llama3x"}) is llama3
