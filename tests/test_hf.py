"""Hugging Face export and import, checked with transformers itself.

Export: random GPT-2-style and Llama-style checkpoints (GQA, untied, another RoPE
base, biases) -> runs/NAME/hf/ that ``AutoModelForCausalLM`` and ``AutoTokenizer``
load: fp32 logits within 1e-4 of ours, identical greedy continuations, the same
token ids. Import: randomly initialised transformers models of several shapes ->
our checkpoint -> HF again gives identical tensors, and the same logits.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hf_helpers import GPT2_DIR, botchan_texts, random_checkpoint, tokenizer_block, train_spm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    return train_spm(tmp_path_factory.mktemp("spm"))


def _ours_logits(model, ids):
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
    with torch.no_grad():
        return model(ids, pos, None)


EXPORT_CASES = {
    # name: (preset, overrides, tokenizer kind)
    "gpt2-tied": ("tiny", {}, "gpt2-bpe"),
    "gpt2-untied": ("tiny", {"tie_embeddings": False, "num_layers": 3}, "sentencepiece"),
    "llama-gqa": ("tiny-llama", {"rotary_base": 500000}, "sentencepiece"),
    "llama-mha-tied-bias": ("tiny-llama", {"num_query_groups": 4, "tie_embeddings": True, "bias": True}, "gpt2-bpe"),
}


@pytest.mark.slow  # transformers' model and generate: ~1-2 s each; the fast tier's 90 s has no room
@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_export_loads_in_transformers_with_same_logits_and_greedy(case, tmp_path, spm_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from snakellm.export.hf import export_hf
    from snakellm.models.loading import load
    from snakellm.serve.generate import Generator, SamplingParams, load_tokenizer

    preset, over, kind = EXPORT_CASES[case]
    tok = tokenizer_block(kind, spm_model)
    model, arch, padded = random_checkpoint(tmp_path / "run", over, tok)
    loaded = load(tmp_path / "run")
    out = export_hf(loaded, tmp_path / "run" / "hf")
    files = sorted(os.listdir(out))
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= set(files)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == ("GPT2LMHeadModel" if arch["style"] == "gpt2" else "LlamaForCausalLM")
    V = tok["vocab_size"]
    assert hf.config.vocab_size == V and padded > V  # the padding rows are trimmed
    ids = torch.randint(0, V, (2, 48), generator=torch.Generator().manual_seed(1))
    ours = _ours_logits(loaded.model, ids)[..., :V]
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-4

    # the same ids from AutoTokenizer as from our encoder
    ours_tok = load_tokenizer(tok)
    at = AutoTokenizer.from_pretrained(out)
    texts = [t for t in botchan_texts(60) if "<" not in t] + ["Hello  world,  ｆｕｌｌ width\tand\nnewlines  ", " lead"]
    for t in texts:
        assert at(t)["input_ids"] == ours_tok.encode(t), t[:60]

    # greedy continuations: ours (KV-cached) == transformers' generate
    gen = Generator(loaded.model, loaded.arch, ours_tok, V)
    prompts = ["It was a fine day", "Botchan"]
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=32, greedy=True, stop_at_eod=False))
    for o in outs:
        x = torch.tensor([o.prompt_ids])
        with torch.no_grad():
            y = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert y[0, x.shape[1] :].tolist() == o.ids


@pytest.mark.slow  # 1.7 s of CPU, among the fast tier's slowest (the tier ran 76-89 s of its 90 s budget)
def test_export_shards_above_the_size_limit(tmp_path):
    from transformers import AutoModelForCausalLM

    from snakellm.export.hf import export_hf
    from snakellm.models.loading import load

    tok = tokenizer_block("gpt2-bpe")
    random_checkpoint(tmp_path / "run", {}, tok)
    loaded = load(tmp_path / "run")
    one = export_hf(loaded, tmp_path / "one")
    many = export_hf(loaded, tmp_path / "many", max_shard_size="200KB")
    index = json.loads((many / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (many / "model.safetensors").exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    # a shard holds one tensor larger than the limit (the embedding), or tensors up to the limit
    sizes = sorted(os.path.getsize(many / s) for s in shards)
    assert sizes[-1] > 12_000_000 and sizes[-2] <= 200_000 + 4096  # + the safetensors header
    a = AutoModelForCausalLM.from_pretrained(one).state_dict()
    b = AutoModelForCausalLM.from_pretrained(many).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unsupported_architecture_is_an_error_before_loading(tmp_path):
    from snakellm.export.hf import ExportError, hf_family
    from snakellm.models.architecture import resolve

    with pytest.raises(ExportError, match="no Hugging Face class"):
        hf_family(resolve("tiny", {"position_embedding": "rope"}))
    with pytest.raises(ExportError, match="grouped-query"):
        hf_family(resolve("tiny", {"num_query_groups": 2}))


# ----------------------------------------------------------------------------- import


def _hf_models(spm: Path):
    from transformers import GPT2Config, LlamaConfig

    V = 50257
    return {
        "gpt2-tied": (
            GPT2Config(
                vocab_size=V,
                n_positions=64,
                n_embd=48,
                n_layer=2,
                n_head=4,
                activation_function="gelu",
                tie_word_embeddings=True,
            ),
            "gpt2",
        ),
        "gpt2-untied-ffn": (
            GPT2Config(
                vocab_size=V,
                n_positions=32,
                n_embd=32,
                n_layer=1,
                n_head=2,
                n_inner=80,
                activation_function="gelu",
                tie_word_embeddings=False,
            ),
            "gpt2",
        ),
        "llama-gqa-untied": (
            LlamaConfig(
                vocab_size=640,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=8,
                num_key_value_heads=2,
                max_position_embeddings=64,
                rope_theta=10000.0,
                tie_word_embeddings=False,
            ),
            "spm",
        ),
        "llama-mha-tied-rope5e5": (
            LlamaConfig(
                vocab_size=600,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=4,
                max_position_embeddings=64,
                rope_theta=500000.0,
                rms_norm_eps=1e-6,
                tie_word_embeddings=True,
            ),
            "spm",
        ),
    }


@pytest.mark.slow  # 3.4 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
@pytest.mark.parametrize("case", ["gpt2-tied", "gpt2-untied-ffn", "llama-gqa-untied", "llama-mha-tied-rope5e5"])
def test_import_roundtrip_identical_tensors_and_logits(case, tmp_path, spm_model):
    import shutil

    from transformers import AutoModelForCausalLM

    from snakellm.export.hf import export_hf, import_hf
    from snakellm.models.loading import load

    config, tokkind = _hf_models(spm_model)[case]
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    src = tmp_path / "src"
    hf.save_pretrained(src)
    if tokkind == "gpt2":
        for f in ("vocab.json", "merges.txt"):
            shutil.copy(GPT2_DIR / f, src / f)
        (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    else:
        shutil.copy(spm_model, src / "tokenizer.model")
    summary = import_hf(src, tmp_path / "run")
    assert summary["arch"]["style"] == ("gpt2" if config.model_type == "gpt2" else "llama")
    loaded = load(tmp_path / "run")
    V = config.vocab_size
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (_ours_logits(loaded.model, ids)[..., :V] - ref).abs().max().item() < 1e-4
    back = export_hf(loaded, tmp_path / "back")
    hf2 = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    a, b = hf.state_dict(), hf2.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    with torch.no_grad():
        assert torch.equal(hf2(ids).logits, ref)


def test_import_rejects_what_it_cannot_compute(tmp_path):
    from snakellm.export.hf import ExportError, arch_from_hf

    with pytest.raises(ExportError, match="activation_function 'gelu_new'"):
        arch_from_hf({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 32})
    with pytest.raises(ExportError, match="rope scaling"):
        arch_from_hf(
            {
                "model_type": "llama",
                "hidden_size": 32,
                "num_attention_heads": 2,
                "num_hidden_layers": 1,
                "intermediate_size": 64,
                "max_position_embeddings": 32,
                "rope_scaling": {"rope_type": "yarn", "factor": 8.0},
            }
        )
    with pytest.raises(ExportError, match="model_type 'phi3'"):
        arch_from_hf({"model_type": "phi3"})


@pytest.mark.slow  # 1.8 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_a_text_preserving_sentencepiece_exports_with_the_same_ids(tmp_path, model_type):
    """Issue 42: the default trained tokenizer (normalization: preserve) keeps runs of spaces as whitespace-only
    pieces ("▁▁"); Hugging Face's Metaspace split them one "▁" a word, so the export's ids differed there."""
    from transformers import AutoTokenizer

    from snakellm.export.hf_tokenizer import export_tokenizer
    from snakellm.tokenize import encoders
    from snakellm.tokenize.sentencepiece_trainer import train_sentencepiece

    src = tmp_path / "b.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in botchan_texts(600)))
    model = tmp_path / "p.model"
    paths = [str(model), str(tmp_path / "p.vocab"), str(tmp_path / "p.json")]
    train_sentencepiece([(str(src), "text")], *paths, vocab_size=600, model_type=model_type)
    ours = encoders.load("sentencepiece", name="p", model_file=str(model))
    out = tmp_path / "hf"
    out.mkdir()
    export_tokenizer(ours.info(), out)
    at = AutoTokenizer.from_pretrained(out)
    texts = [t for t in botchan_texts(60) if "<" not in t]
    texts += ["a   b", "     indented", "  lead", "trail   ", "   ", "x 2026  y", "code:\n\tif  x:\n\t\treturn   1\n"]
    for t in texts:
        ids = ours.encode(t)
        assert at(t, add_special_tokens=False)["input_ids"] == ids, t[:60]
        assert at.decode(ids) == ours.decode(ids) == t


def test_any_tokenizer_json_exports_with_the_same_ids(tmp_path, spm_model):
    """kind huggingface: the tokenizer.json goes as is, AutoTokenizer gives our ids (and the EOD as eos)."""
    from transformers import AutoTokenizer

    from snakellm.export.hf_tokenizer import export_tokenizer, sentencepiece_tokenizer_json
    from snakellm.tokenize import encoders

    tj = tmp_path / "tokenizer.json"
    sentencepiece_tokenizer_json(spm_model)[0].save(str(tj))  # some tokenizer.json (a Unigram/BPE pipeline)
    ours = encoders.load("huggingface", name="hf", tokenizer_file=str(tj), eod="</s>")
    out = tmp_path / "hf"
    out.mkdir()
    specials = export_tokenizer(ours.info(), out)
    at = AutoTokenizer.from_pretrained(out)
    assert specials["eos_token_id"] == ours.eod_id == at.eos_token_id
    for t in [t for t in botchan_texts(40) if "<" not in t]:
        assert at(t)["input_ids"] == ours.encode(t)


@pytest.mark.slow
def test_random_hf_writes_a_directory_transformers_and_import_hf_read(tmp_path):
    """`snakellm random-hf`: a preset's shape with random weights, as transformers loads it; import-hf of it
    gives transformers' logits (what the 8B chain example starts from, here at tiny-llama's shape)."""
    from transformers import AutoModelForCausalLM

    from snakellm.export.hf import import_hf
    from snakellm.models.loading import load
    from snakellm.steps.random_hf import main

    out = tmp_path / "models" / "random" / "x"
    argv = [str(out), "--preset", "tiny-llama", "--seed", "3", "--tokenizer-dir", str(GPT2_DIR)]
    assert main(argv) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (
        "llama",
        2,
        64,
        50257,
    )
    assert {"vocab.json", "merges.txt", "model.safetensors"} <= set(os.listdir(out))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    w = dict(hf.named_parameters())
    assert abs(w["model.layers.0.mlp.down_proj.weight"].std().item() - 0.02) < 0.002  # the init's scale
    assert torch.equal(w["model.norm.weight"], torch.ones(64))
    import_hf(out, tmp_path / "run")
    loaded = load(tmp_path / "run")
    loaded.model.float()
    ids = torch.randint(0, 50257, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (_ours_logits(loaded.model, ids)[..., :50257] - theirs).abs().max().item() < 1e-4
    assert (
        main([str(tmp_path / "again"), "--preset", "tiny-llama", "--seed", "3", "--tokenizer-dir", str(GPT2_DIR)]) == 0
    )
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert main([str(tmp_path / "bad"), "--preset", "tiny-llama", "--tokenizer-dir", str(tmp_path)]) == 2
