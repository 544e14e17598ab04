"""LoRA on megatron-core linears: zero-start, merge, and Hugging Face PEFT logits (CPU, random tiny models).

The Hugging Face base is our own export (snakellm.export.hf), loaded by transformers; PEFT then loads our
PEFT-format adapter onto it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from snakellm.finetune import runtime  # noqa: E402
from snakellm.models import architecture as models  # noqa: E402

VOCAB = 256


@pytest.fixture(scope="module")
def rt():
    r = runtime.start("cpu", 1, threads=1, seed=3)
    yield r
    runtime.stop()


def _model(style: str, seed: int = 3):
    from megatron.core import tensor_parallel

    preset = {"gpt2": "tiny", "llama": "tiny-llama", "qwen3": "tiny-qwen3"}[style]
    arch = models.resolve(preset, {"seq_length": 32})
    torch.manual_seed(seed)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    from snakellm.models.build import build_model

    gpt, _ = build_model(arch, VOCAB, fused_loss="eager")
    return gpt.eval(), arch


def _export_hf(gpt, arch: dict, out: Path):
    """Our Hugging Face export of an in-memory model, read back by transformers."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from snakellm.export.hf import export_hf

    loaded = SimpleNamespace(
        model=gpt, arch=arch, tokenizer={"vocab_size": VOCAB}, padded_vocab_size=VOCAB, checkpoint="test", iteration=0
    )
    export_hf(loaded, out, dtype="float32")
    return AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()


def _logits(gpt, tokens):
    pos = torch.arange(tokens.size(1)).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return gpt(tokens, pos, None).float()


@pytest.mark.parametrize("style", ["gpt2", "llama", "qwen3"])
def test_lora_zero_start_merge_and_peft_logits(rt, style: str, tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import save_file

    from snakellm.finetune.lora import TARGETS, LoRAAdapters, LoRAConfig, full_tensors, load_full_tensors, merge
    from snakellm.finetune.peft_export import write_peft

    gpt, arch = _model(style)
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    base = _logits(gpt, tokens)
    hf = _export_hf(gpt, arch, tmp_path / "hf")
    with torch.no_grad():
        assert torch.allclose(hf(tokens).logits.float(), base, atol=2e-5), "Hugging Face export"
    base_weights = {k: v.clone() for k, v in gpt.state_dict().items() if torch.is_tensor(v)}

    cfg = LoRAConfig(rank=4, alpha=8.0, targets=TARGETS, layers=None, seed=11, modules_to_save=("final_layernorm",))
    ad = LoRAAdapters(gpt, cfg)
    assert len(list(ad.named_adapters())) == 4 * arch["num_layers"]
    assert torch.equal(_logits(gpt, tokens), base)  # B starts at zero (NeMo's row_init: zero)
    a_std = torch.cat([m.a.flatten() for _, m in ad.named_adapters()]).std().item()
    assert 0.05 < a_std < 0.3  # xavier-normal A
    with torch.no_grad():  # a trained-looking adapter
        g = torch.Generator().manual_seed(5)
        for _, m in ad.named_adapters():
            m.b.copy_(torch.randn(m.b.shape, generator=g) * 0.05)
        for _, p in ad.saved_parameters():  # the final norm trained beside them (modules_to_save)
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    tuned = _logits(gpt, tokens)
    assert (tuned - base).abs().max() > 1e-2

    # the adapter as an artifact, alone: reload into a fresh copy of the base
    tensors = full_tensors(ad)
    adir = tmp_path / "adapter"
    adir.mkdir()
    save_file(tensors, str(adir / "adapter.safetensors"))
    (adir / "adapter_config.json").write_text(json.dumps({"lora": cfg.as_dict(), "model": arch, "padded_vocab": VOCAB}))
    gpt2_, _ = _model(style)
    ad2 = LoRAAdapters(gpt2_, cfg)
    load_full_tensors(ad2, tensors)
    assert torch.equal(_logits(gpt2_, tokens), tuned)

    # PEFT format onto the Hugging Face base: the same logits
    write_peft(adir, tmp_path / "peft", str(tmp_path / "hf"))
    conf = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["lora_alpha"] == 8.0
    assert conf["base_model_name_or_path"] == str(tmp_path / "hf")  # the adapter names its base
    assert conf["modules_to_save"] == [
        {"gpt2": "transformer.ln_f", "llama": "model.norm", "qwen3": "model.norm"}[style]
    ]
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        peft_logits = peft_model(tokens).logits.float()
    assert torch.allclose(peft_logits, tuned, atol=2e-5), (peft_logits - tuned).abs().max()

    # merged into the base: the same logits, adapters gone, only adapted weights (and the saved norm) changed
    merge(gpt, ad)
    assert torch.allclose(_logits(gpt, tokens), tuned, atol=2e-5)
    changed = {k for k, v in gpt.state_dict().items() if torch.is_tensor(v) and not torch.equal(v, base_weights[k])}
    norm = {"decoder.final_layernorm.weight"} | ({"decoder.final_layernorm.bias"} if style == "gpt2" else set())
    assert changed == norm | {
        f"decoder.layers.{i}.{s}.{t}.weight"
        for i in range(arch["num_layers"])
        for s, t in (
            ("self_attention", "linear_qkv"),
            ("self_attention", "linear_proj"),
            ("mlp", "linear_fc1"),
            ("mlp", "linear_fc2"),
        )
    }


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_ptuning_prompt_table_as_peft_prompt_tuning(rt, style: str, tmp_path: Path) -> None:
    """p-tuning's prompt table in PEFT's prompt-tuning format: AutoPeftModelForCausalLM loads it onto the base
    its config names and gives our logits (virtual tokens in front, the prompt after them)."""
    from peft import AutoPeftModelForCausalLM
    from safetensors.torch import save_file

    from snakellm.finetune.peft_export import write_prompt_tuning
    from snakellm.finetune.ptuning import PTuning, PTuningConfig

    gpt, arch = _model(style)
    _export_hf(gpt, arch, tmp_path / "hf")
    pt = PTuning(
        gpt,
        PTuningConfig(virtual_tokens=3, encoder="mlp", hidden=16, seed=2),
        arch["hidden_size"],
        torch.float32,
        torch.device("cpu"),
    )
    try:
        table = pt.virtual_embeddings().detach()
        tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
        ours = _logits(gpt, torch.cat([torch.zeros(2, 3, dtype=torch.long), tokens], dim=1))  # 3 placeholders
    finally:
        pt.remove()
    src = tmp_path / "prompt"
    src.mkdir()
    save_file({"prompt_table": table.contiguous()}, str(src / "virtual_tokens.safetensors"))
    (src / "prompt_config.json").write_text(json.dumps({"method": "ptuning", "model": arch}))
    write_prompt_tuning(src, tmp_path / "peft", str(tmp_path / "hf"))
    conf = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert conf["peft_type"] == "PROMPT_TUNING" and conf["num_virtual_tokens"] == 3
    assert conf["base_model_name_or_path"] == str(tmp_path / "hf")
    model = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "peft"), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(input_ids=tokens).logits.float()
    assert theirs.shape == ours.shape
    assert torch.allclose(theirs, ours, atol=2e-5), (theirs - ours).abs().max()


def test_lora_options_checked_and_layer_selection(rt) -> None:
    from snakellm.finetune.lora import LoRAAdapters, LoRAConfig

    with pytest.raises(ValueError, match="targets"):
        LoRAConfig(targets=("linear_q",))
    with pytest.raises(ValueError, match="column_init"):
        LoRAConfig(column_init="orthogonal")
    gpt, arch = _model("gpt2")
    ad = LoRAAdapters(gpt, LoRAConfig(rank=2, targets=("linear_qkv", "linear_fc2"), layers=(2,)))
    assert sorted(n for n, _ in ad.named_adapters()) == [
        "decoder.layers.1.mlp.linear_fc2",
        "decoder.layers.1.self_attention.linear_qkv",
    ]
    ad.remove()
    with pytest.raises(ValueError, match="layers 1..2"):
        LoRAAdapters(gpt, LoRAConfig(layers=(3,)))


def test_lora_trains_only_the_adapters_params_grads_and_optimizer_state(rt) -> None:
    """LoRA through the assembly's own wrapping (megatron-core DDP, fp32 gradient buffers, MixedPrecisionAdamW)
    on a bf16 model: gradient buffers, fp32 master weights and Adam's moments exist for the adapters' parameters
    only, and one step moves the adapters while every base weight stays bit-identical."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from snakellm.finetune.lora import LoRAConfig
    from snakellm.finetune.recipe import FinetuneRecipe, attach
    from snakellm.train.optim import MixedPrecisionAdamW

    gpt, arch = _model("llama")
    gpt = gpt.bfloat16().train()
    targets = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    ft, ad = attach(torch, gpt, "lora", LoRAConfig(rank=4, targets=targets, row_init="normal"), arch)
    trained = {id(p) for p in ad.parameters()}
    n_ad = sum(p.numel() for p in ad.parameters())
    base = {n: p.detach().clone() for n, p in gpt.named_parameters() if id(p) not in trained}
    assert n_ad and base and all(not p.requires_grad for p in gpt.parameters() if id(p) not in trained)
    model = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), ft)
    assert {id(p) for p in ft.parameters() if p.requires_grad} == trained
    assert sum(b.grad_data.numel() for b in model.buffers) == n_ad  # gradient buffers: the adapters' only
    assert all(not hasattr(p, "main_grad") for p in gpt.parameters() if id(p) not in trained)
    opt = MixedPrecisionAdamW(model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.98), eps=1e-8, clip_grad=1.0)
    assert sum(m.numel() for g in opt.master_groups for m in g) == n_ad  # fp32 masters: the adapters' only
    before = {id(p): p.detach().clone() for p in ad.parameters()}
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {
        "tokens": tokens,
        "labels": tokens.roll(-1, 1),
        "position_ids": torch.arange(16).expand(2, 16),
        "loss_mask": torch.ones(2, 16),
    }
    model.zero_grad_buffer()
    FinetuneRecipe.loss(model, batch).backward()
    model.finish_grad_sync()
    opt.step(1e-2)
    state = opt.optimizer.state.values()
    assert sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in state) == 2 * n_ad  # Adam: adapters only
    assert all(p.grad is None for p in gpt.parameters() if id(p) not in trained)
    assert all(torch.equal(p, base[n]) for n, p in gpt.named_parameters() if n in base)
    assert any(not torch.equal(p, before[id(p)]) for p in ad.parameters())


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_lora_under_activation_recomputation_has_the_same_gradients(rt, recompute: str) -> None:
    """finetune.<name>.parallel.recompute: LoRA's gradients equal those without recomputation (a frozen base's
    embedding output is made to need a gradient, else a recomputed layer would pass none to its adapters)."""
    from megatron.core import tensor_parallel

    from snakellm.finetune.lora import LoRAConfig
    from snakellm.finetune.recipe import attach
    from snakellm.models.build import build_model

    arch = models.resolve("tiny-llama", {"seq_length": 32})
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = {}
    for rc in ("none", recompute):
        torch.manual_seed(3)
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        gpt, _ = build_model(arch, VOCAB, fused_loss="eager", recompute=rc)
        ft, ad = attach(torch, gpt.train(), "lora", LoRAConfig(rank=4, row_init="normal"), arch, rc)
        ft(tokens, torch.arange(16).expand(2, 16), None, labels=tokens.roll(-1, 1)).float().mean().backward()
        grads[rc] = [p.grad for p in ad.parameters()]
        with torch.no_grad():  # validation: no gradient asked for, none made
            assert not ft(tokens, torch.arange(16).expand(2, 16), None, labels=tokens).requires_grad
    assert all(g is not None and g.abs().sum() > 0 for g in grads[recompute])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads["none"], grads[recompute], strict=True))


@pytest.mark.slow  # ~5 s for both (torch.compile): the slow tier (fast-tier budget)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_compiled_lora_layers_trace_whole_and_match_eager(rt, method: str) -> None:
    """parallel.compile (train and finetune): each layer, adapters included, is one graph (megatron-core's per-call
    tensor-parallel group warning broke it on rank 0, in the frozen and the trained linears' helpers:
    snakellm.models.build.pass_tp_group), and the compiled model's loss and gradients equal eager's."""
    from megatron.core import tensor_parallel
    from torch._dynamo.utils import counters

    from snakellm.finetune.lora import LoRAConfig
    from snakellm.finetune.recipe import attach
    from snakellm.models.build import build_model, pass_tp_group

    arch = models.resolve("tiny-llama", {"seq_length": 32})
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    out = {}
    pass_tp_group()
    torch._dynamo.reset()
    counters.clear()
    for compiled in (False, True):
        torch.manual_seed(3)
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        gpt, _ = build_model(arch, VOCAB, fused_loss="eager")
        ft, ad = attach(torch, gpt.train(), method, LoRAConfig(rank=4, row_init="normal"), arch)
        trained = [p for p in (ad or ft).parameters() if p.requires_grad]
        if compiled:  # compile_each_layer's call, with a backend that needs no C++ compiler
            for layer in gpt.decoder.layers:
                layer.compile(backend="aot_eager", dynamic=False)
        loss = ft(tokens, torch.arange(16).expand(2, 16), None, labels=tokens.roll(-1, 1)).float().mean()
        loss.backward()
        out[compiled] = (loss.detach(), [p.grad for p in trained])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    assert torch.allclose(out[False][0], out[True][0], atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(out[False][1], out[True][1], strict=True))
