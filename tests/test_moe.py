"""Mixture-of-experts families (megatron-core's own MoE layer) against transformers, and their settings.

Tiny random Mixtral (and Qwen3-MoE) models saved by transformers' ``save_pretrained``: import gives
transformers' logits (fp32, 1e-4), the KV-cached decoder's greedy tokens equal transformers'
``generate``, and export gives back identical tensors and logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hf_helpers import train_spm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

SHAPE = dict(
    vocab_size=600,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _configs():
    from transformers import MixtralConfig, Qwen3MoeConfig

    out = {
        "mixtral": MixtralConfig(**SHAPE, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
        "qwen3-moe": Qwen3MoeConfig(
            **SHAPE,
            head_dim=32,  # not hidden_size / heads (16): Qwen3's own head width
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
        ),
        "qwen3-moe-unnormalised": Qwen3MoeConfig(
            **SHAPE,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        ),
    }
    return out


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    return train_spm(tmp_path_factory.mktemp("spm"))


def save_tiny(config, src: Path, spm: Path):
    """A transformers model of ``config`` (norms perturbed away from ones) saved with its tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(src)
    shutil.copy(spm, src / "tokenizer.model")
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return hf


@pytest.mark.parametrize("case", list(_configs()))
def test_moe_import_generate_export_against_transformers(case, tmp_path, spm_model):
    from transformers import AutoModelForCausalLM

    from snakellm.export.hf import export_hf, import_hf
    from snakellm.models.loading import load
    from snakellm.serve.generate import Generator, SamplingParams, load_tokenizer

    config = _configs()[case]
    hf = save_tiny(config, tmp_path / "src", spm_model)
    arch = import_hf(tmp_path / "src", tmp_path / "run")["arch"]
    experts = config.num_local_experts if case == "mixtral" else config.num_experts
    assert arch["num_experts"] == experts
    loaded = load(tmp_path / "run")
    V = config.vocab_size
    ids = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(40).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        ref = hf(ids).logits
        ours = loaded.model(ids, pos, None)[..., :V]
    assert (ours - ref).abs().max().item() < 1e-4

    gen = Generator(loaded.model, loaded.arch, load_tokenizer(loaded.tokenizer), V)
    prompts = [ids[0, :8].tolist(), ids[1, :5].tolist()]
    for prompt in prompts:
        x = torch.tensor([prompt])
        with torch.no_grad():
            y = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=20,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        # batch 1: the decode steps read only the routed experts; a prefill runs each expert on its tokens
        out = gen.generate([prompt], SamplingParams(max_new_tokens=20, greedy=True, stop_at_eod=False))[0]
        assert out.ids == y[0, len(prompt) :].tolist()
    # batched (left-padded rows of different lengths) gives each row's batch-1 tokens
    both = gen.generate(prompts, SamplingParams(max_new_tokens=12, greedy=True, stop_at_eod=False))
    for prompt, row in zip(prompts, both):
        one = gen.generate([prompt], SamplingParams(max_new_tokens=12, greedy=True, stop_at_eod=False))[0]
        assert row.ids == one.ids

    back = export_hf(loaded, tmp_path / "back")
    hf2 = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    assert type(hf2).__name__ == type(hf).__name__
    a, b = hf.state_dict(), hf2.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    with torch.no_grad():
        assert torch.equal(hf2(ids).logits, ref)


def test_moe_settings_resolve_and_refuse_with_the_key():
    from snakellm.models import ModelConfigError, param_count, resolve

    dense = resolve("tiny-llama")
    assert "num_experts" not in dense and "moe_router_topk" not in dense  # a dense model's dict is unchanged
    with pytest.raises(ModelConfigError, match="moe_router_topk: mixture-of-experts keys need num_experts"):
        resolve("tiny-llama", {"moe_router_topk": 2})
    with pytest.raises(ModelConfigError, match="moe_router_topk 5 is more than num_experts 4"):
        resolve("tiny-mixtral", {"moe_router_topk": 5})
    with pytest.raises(ModelConfigError, match="moe_norm_topk_prob false with moe_score_function sigmoid"):
        resolve("tiny-mixtral", {"moe_score_function": "sigmoid", "moe_norm_topk_prob": False})
    tiny = resolve("tiny-mixtral")
    assert (tiny["num_experts"], tiny["moe_router_topk"], tiny["moe_ffn_hidden_size"]) == (4, 2, 96)
    # Mixtral 8x7B: 46.7B parameters, 12.9B active (Mistral AI's figures)
    big = resolve("mixtral-8x7b")
    assert round(param_count(big, 32000) / 1e9, 1) == 46.7
    assert round(param_count(big, 32000, active=True) / 1e9, 1) == 12.9
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B active (Qwen's model card)
    qwen = resolve("qwen3-30b-a3b")
    assert round(param_count(qwen, 151936) / 1e9, 1) == 30.5
    assert round(param_count(qwen, 151936, active=True) / 1e9, 1) == 3.4  # 3.35: the card rounds down


def test_export_refuses_a_router_the_hf_class_does_not_have():
    from snakellm.models import families, resolve

    arch = resolve("tiny-mixtral", {"moe_norm_topk_prob": False})
    with pytest.raises(families.FamilyError, match="moe_norm_topk_prob False: MixtralForCausalLM has True"):
        families.for_arch(arch)
    with pytest.raises(families.FamilyError, match="num_experts=4: LlamaForCausalLM is dense"):
        families.for_arch({**resolve("tiny-mixtral"), "style": "llama"})


def test_memory_counts_experts_sharded_by_ep_and_the_plan_names_ep():
    from snakellm.models import memory, moe, param_count, resolve

    arch = resolve("qwen3-30b-a3b")
    vocab = 151936
    one = memory.estimate(arch, vocab, dp=8)
    eight = memory.estimate(arch, vocab, dp=8, ep=8)
    assert one.params == param_count(arch, vocab)  # every expert on one GPU
    experts = arch["num_layers"] * arch["num_experts"] * moe.expert_params(arch)
    assert one.params - eight.params == experts - experts // 8  # an eighth of them at ep 8
    assert eight.weights == eight.params * 2 and eight.optimizer == eight.params * 12
    assert "experts over ep 8" in eight.lines()[0]
    # a MoE layer keeps each token's top-k copies through its experts (input, up-projection, down input and the
    # dispatcher's permuted copy), whatever the number of experts: k x (2 h + 3 f) per token in bf16
    s, h, f = arch["seq_length"], arch["hidden_size"], arch["moe_ffn_hidden_size"]
    two = dict(arch, moe_router_topk=2)
    per_k = (memory.layer_activation_bytes(arch, 1) - memory.layer_activation_bytes(two, 1)) / 6
    assert per_k == 2 * s * (2 * h + 3 * f)
    assert memory.layer_activation_bytes(dict(arch, num_experts=64), 1) < memory.layer_activation_bytes(arch, 1)
