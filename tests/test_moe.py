"""Mixture-of-experts families (megatron-core's own MoE layer) against transformers, and their settings.

Tiny random Mixtral (and Qwen3-MoE) models saved by transformers' ``save_pretrained``: import gives
transformers' logits (fp32, 1e-4), the KV-cached decoder's greedy tokens equal transformers'
``generate``, and export gives back identical tensors and logits.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hf_helpers import save_random_hf, train_spm

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
    """A transformers model of ``config`` (norms perturbed away from ones; these classes have no biases)."""
    return save_random_hf(config, src, spm, {"eos_token": "</s>"})


@pytest.mark.slow  # transformers' MoE models and generate: ~1 s each; the fast tier's 90 s has no room
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


def test_grouped_experts_compute_what_megatron_cores_loop_does():
    """The grouped matrix products (torch._grouped_mm) against SequentialMLP's loop, one model's weights:
    the same logits and the same gradients of every expert (fp32), the same checkpoint keys."""
    from snakellm.launch import runtime
    from snakellm.models import resolve
    from snakellm.models.build import build_model
    from snakellm.models.moe import grouped_experts_class

    runtime.ensure_single_process("cpu")
    arch = resolve("tiny-qwen3-moe", {"seq_length": 32})
    grouped, _ = build_model(arch, 256, seed=5, moe_experts="grouped")
    loop, _ = build_model(arch, 256, seed=5, moe_experts="sequential")
    assert type(grouped.decoder.layers[0].mlp.experts) is not type(loop.decoder.layers[0].mlp.experts)
    assert isinstance(grouped.decoder.layers[0].mlp.experts, grouped_experts_class().__mro__[1])
    assert grouped.state_dict().keys() == loop.state_dict().keys()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(32)[None].expand(2, -1)
    outs = []
    for m in (grouped, loop):
        m.train()
        loss = m(ids, pos, None, labels=ids).mean()
        loss.backward()
        outs.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (la, ga), (lb, gb) = outs
    assert torch.allclose(la, lb, rtol=1e-6, atol=1e-6)
    assert ga.keys() == gb.keys() and any("local_experts" in n for n in ga)
    for n in ga:
        assert torch.allclose(ga[n], gb[n], rtol=1e-4, atol=1e-6), n


@pytest.mark.parametrize("overlap", [False, True])
def test_grouped_experts_add_their_gradients_into_ddps_buffers_once(overlap: bool):
    """Under megatron-core DDP the grouped experts add their weight gradients into DDP's ``main_grad``
    buffers themselves (one add a pass) and autograd gets none for them (without overlapped reduction the
    weights are not even inputs of the graph: one operator a product, ``snakellm::experts_linear``, takes
    views of the weights and of DDP's buffer; with it, placeholders fire DDP's hooks): two micro-batches
    accumulate exactly what SequentialMLP's weights accumulate through DDP's own hooks (fp32), and the
    experts share one storage a layer, in the order the dispatcher hands over their tokens (last first,
    DDP's buffer's order), which the grouped products view without a copy. Without overlap the experts'
    part of the buffer is not zeroed (``defer_expert_zeroing``, as the assembly sets it): the second step
    gets the same gradients as the first, not their sum, and a step without a backward pass leaves them
    zero."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig

    from snakellm.launch import runtime
    from snakellm.models import resolve
    from snakellm.models.build import build_model
    from snakellm.models.moe import defer_expert_zeroing, grads_to_buffers_only, stacked, stacked_view

    runtime.ensure_single_process("cpu")
    arch = resolve("tiny-qwen3-moe", {"seq_length": 32})
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2, 32), generator=gen) for _ in range(2)]
    pos = torch.arange(32)[None].expand(2, -1)
    main = {}
    for kind in ("grouped", "sequential"):
        model, tcfg = build_model(arch, 256, seed=5, moe_experts=kind)
        ddp = DDP(tcfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap), model)
        for p in ddp.parameters():  # what the assembly sets where DDP overlaps: its hooks must still fire
            p.ddp_hook_needs_grad = overlap
        deferred = defer_expert_zeroing(ddp)
        assert deferred == (0 if overlap or kind == "sequential" else 2 * arch["num_layers"])
        ddp.train()
        steps = []
        for _ in range(2):
            ddp.zero_grad_buffer()
            for ids in batches:
                ddp(ids, pos, None, labels=ids).mean().backward()
            ddp.finish_grad_sync()
            steps.append({n: p.main_grad.clone() for n, p in ddp.module.named_parameters()})
        for n, g in steps[0].items():
            assert torch.equal(g, steps[1][n]), n
        main[kind] = steps[0]
        mlp = model.decoder.layers[0].mlp
        experts = [e.linear_fc1.weight for e in mlp.experts.local_experts]
        shortcut = "dispatch_postprocess" in vars(mlp.token_dispatcher)
        assert shortcut == (kind == "grouped")  # one rank: no host copy of the counts, no identity sort
        if kind == "sequential":
            assert not any(w.grad_added_to_main_grad for w in experts)
        else:
            assert all(w.grad is None for w in experts)  # DDP's hook added nothing
            # without overlap the compilable operator takes them (DDP's buffer views); with it the eager products
            assert (getattr(mlp.experts, "buffer_path", None) is not None) is not overlap
            assert all(w.grad_added_to_main_grad for w in experts) is overlap
            # without overlap the weights are no inputs of the autograd graph (no per-expert backward nodes)
            assert grads_to_buffers_only(torch.ones(1, requires_grad=True), experts) is not overlap
            in_order = mlp.experts.in_token_order("linear_fc1")
            assert in_order == experts[::-1]  # the dispatcher hands the tokens over last expert first
            view = stacked(in_order)
            assert view.untyped_storage().data_ptr() == experts[-1].untyped_storage().data_ptr()
            assert view.data_ptr() == experts[-1].data_ptr()  # a view, no copy
            grads = stacked_view([w.main_grad for w in in_order])
            assert grads is not None and not grads[1]  # DDP's buffer holds them last first too: one add, as they are
        if not overlap:  # (overlapped, DDP refuses a step without a backward pass)
            ddp.zero_grad_buffer()
            ddp.finish_grad_sync()  # a step whose experts had no backward pass
            assert all(not p.main_grad.any() for p in ddp.module.parameters())
    assert main["grouped"].keys() == main["sequential"].keys()
    assert any("local_experts" in n for n in main["grouped"])
    for n, g in main["grouped"].items():
        assert g.abs().sum() > 0, n
        assert torch.allclose(g, main["sequential"][n], rtol=1e-4, atol=1e-6), n


@pytest.mark.slow  # 2.0 s of CPU, among the fast tier's slowest (the tier ran 76-89 s of its 90 s budget)
def test_the_training_page_draws_router_health_only_for_a_mixture_of_experts(tmp_path):
    from snakellm.report.train import router_figure, summary_page

    recs = [
        {
            "step": s,
            "loss": 5.0 - s / 10,
            "moe_tokens_per_expert": [100 + s, 90, 80, 130 - s],
            "moe_max_load": (130 - s) / 100 if s < 15 else (100 + s) / 100,
            "moe_aux_loss": 1.1 - s / 100,
            "moe_z_loss": 2.0,
            "moe_dropped_tokens": 0,
        }
        for s in range(1, 21)
    ]
    svg = router_figure("mix", recs)
    assert svg is not None and svg.startswith("<svg") and "router health" in svg
    page = summary_page("mix", recs, {"status": "done"}, str(tmp_path / "train_summary.json"))
    assert "Router health (mixture of experts)" in page and "<svg" in page
    dense = [{k: v for k, v in r.items() if not k.startswith("moe_")} for r in recs]
    assert router_figure("d", dense) is None
    assert "Router health" not in summary_page("d", dense, {"status": "done"}, str(tmp_path / "s.json"))


@pytest.mark.slow  # 1.7 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_the_engine_generates_the_eager_decoders_tokens_for_moe(preset):
    """The serving engine's decode step (every row's experts, capturable) and prefill give the eager decoder's
    greedy tokens and log-probabilities (which gathers each token's routed experts)."""
    from hf_helpers import tokenizer_block
    from test_engine import PROMPTS, build_gen, engine, greedy

    gen = build_gen(preset, tokenizer_block("gpt2-bpe"))
    params = greedy(12, stop_at_eod=False, logprobs=True)
    fast = engine(gen).generate(PROMPTS, params)
    eager = gen.generate(PROMPTS, params)
    assert [o.ids for o in fast] == [o.ids for o in eager]
    for f, e in zip(fast, eager, strict=True):
        assert f.logprobs == pytest.approx(e.logprobs, abs=1e-4)


def test_lora_adapts_a_moe_models_attention_and_names_what_it_cannot():
    from snakellm.finetune.lora import LoRAAdapters, LoRAConfig
    from snakellm.launch import runtime
    from snakellm.models import resolve
    from snakellm.models.build import build_model

    runtime.ensure_single_process("cpu")
    model, _ = build_model(resolve("tiny-mixtral", {"seq_length": 32}), 256, seed=1)
    with pytest.raises(ValueError, match="LoRA on linear_fc1: layer 1's MLP is a mixture of experts .*4 experts"):
        LoRAAdapters(model, LoRAConfig(rank=4, alpha=8, targets=("linear_qkv", "linear_fc1")))
    lora = LoRAAdapters(model, LoRAConfig(rank=4, alpha=8, targets=("linear_qkv", "linear_proj")))
    assert len(dict(lora.named_adapters())) == 4  # 2 layers x 2 attention linears


@pytest.mark.slow  # torch.compile of two layers on the CPU: 3-9 s apiece, the fast tier's 90 s has no room
@pytest.mark.parametrize("one_rank", [True, False])
def test_compiled_layers_keep_what_dynamo_cannot_take_of_the_mixture_of_experts_eager(one_rank: bool):
    """compile_each_layer's eager_moe: where the dispatcher waits for nothing (one rank) the MoE MLP compiles
    with its layer, the router's aux-loss and z-loss bookkeeping traced with the layer's index as a tensor
    (one compilation for all layers: a recompilation raises here); elsewhere (the alltoall dispatcher's side
    stream and ``record_stream``) the whole MLP stays eager; either once however often it is applied. The
    layers compiled (Dynamo, the aot_eager backend on the CPU): the loss, the aux loss tracked per layer and
    the router's gradients are those of the untouched model (fp32, within rounding)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    from snakellm.launch import runtime
    from snakellm.models import resolve
    from snakellm.models.build import build_model, eager_moe, pass_tp_group

    runtime.ensure_single_process("cpu")
    arch = resolve("tiny-qwen3-moe", {"seq_length": 32, "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001})
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(32)[None].expand(2, -1)
    runs = []
    for compiled in (False, True):
        gpt, _ = build_model(arch, 256, seed=7)
        if compiled:
            torch._dynamo.reset()  # no compiled code of another test's layers
            pass_tp_group()
            for layer in gpt.decoder.layers:
                mlp = layer.mlp
                assert mlp.token_dispatcher.waits_for_nothing
                if not one_rank:
                    del mlp.token_dispatcher.waits_for_nothing
                eager_moe(layer)
                steps = (mlp.forward, mlp.router.attach_and_log_load_balancing_loss, mlp.router.apply_z_loss)
                eager_moe(layer)
                assert (mlp.forward, mlp.router.attach_and_log_load_balancing_loss, mlp.router.apply_z_loss) == steps
                disabled = [getattr(f, "_torchdynamo_disable", False) for f in steps]
                assert disabled == ([False, False, False] if one_rank else [True, False, False])
                assert hasattr(mlp.router, "snakellm_slot") is one_rank
                layer.compile(backend="aot_eager", dynamic=False)
        clear_aux_losses_tracker()
        gpt.train()
        with torch._dynamo.config.patch(error_on_recompile=compiled):
            loss = gpt(ids, pos, None, labels=ids).mean()
            loss.backward()
        tracked = {k: v["values"].clone() for k, v in get_moe_layer_wise_logging_tracker().items()}
        grads = {n: p.grad.clone() for n, p in gpt.named_parameters() if "router" in n}
        runs.append((loss.detach(), tracked, grads))
    (la, ta, ga), (lb, tb, gb) = runs
    close = functools.partial(torch.allclose, rtol=1e-5, atol=1e-7)
    assert close(la, lb)
    assert ta.keys() == tb.keys() == {"load_balancing_loss", "z_loss"} and all(close(ta[k], tb[k]) for k in ta)
    assert all(v.abs().sum() > 0 for v in ta.values())  # the tracker holds each layer's aux loss
    assert ga.keys() == gb.keys() and ga and all(close(ga[n], gb[n]) for n in ga)


def test_the_permutation_without_host_synchronisation_is_megatrons():
    """``permute_without_sync`` (``nonzero_static`` where megatron-core's ``permute`` uses ``masked_select``,
    which waits for the device) gives megatron-core's permuted tokens, probabilities and indices, and the
    same gradients, for a dropless top-k routing map (k distinct experts a token)."""
    from megatron.core.transformer.moe.moe_utils import permute

    from snakellm.models.moe import permute_without_sync

    gen = torch.Generator().manual_seed(3)
    tokens_n, experts, k, hidden = 37, 8, 3, 5
    top = torch.rand(tokens_n, experts, generator=gen).topk(k, dim=1).indices
    routing_map = torch.zeros(tokens_n, experts, dtype=torch.bool).scatter(1, top, True)
    outs = []
    for fn in (permute, permute_without_sync):
        x = torch.randn(tokens_n, hidden, generator=torch.Generator().manual_seed(4), requires_grad=True)
        probs = torch.rand(tokens_n, experts, generator=torch.Generator().manual_seed(5), requires_grad=True)
        y, p, idx = fn(x, routing_map, probs=probs, num_out_tokens=tokens_n * k)
        (y * torch.arange(y.numel()).view_as(y)).sum().backward(retain_graph=True)
        (p * torch.arange(p.numel())).sum().backward()
        outs.append((y.detach(), p.detach(), idx, x.grad, probs.grad))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow  # Dynamo compiles two models' layers (10-20 s on 2 cores)
def test_compiled_layers_under_ddp_run_the_experts_and_the_aux_losses_in_their_graph():
    """At one rank under megatron-core DDP (no overlap, the experts' zeroing deferred, as the assembly sets
    it), a compiled layer keeps the grouped experts (``snakellm::experts_linear``, its backward writing
    DDP's buffer) and the router's aux-loss bookkeeping in its graph: no graph break names either, no
    recompilation from one layer to the next; two steps of two micro-batches accumulate the eager model's
    ``main_grad`` (fp32, within rounding) and the same per-layer aux losses."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    from snakellm.launch import runtime
    from snakellm.models import resolve
    from snakellm.models.build import build_model, eager_moe, pass_tp_group
    from snakellm.models.moe import defer_expert_zeroing

    runtime.ensure_single_process("cpu")
    arch = resolve("tiny-qwen3-moe", {"seq_length": 32, "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001})
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2, 32), generator=gen) for _ in range(2)]
    pos = torch.arange(32)[None].expand(2, -1)
    runs = []
    for compiled in (False, True):
        model, tcfg = build_model(arch, 256, seed=5)
        ddp = DDP(tcfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        assert defer_expert_zeroing(ddp) == 2 * arch["num_layers"]
        assert all(layer.mlp.experts.buffer_path is not None for layer in model.decoder.layers)
        if compiled:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            pass_tp_group()
            for layer in model.decoder.layers:
                eager_moe(layer)
                layer.compile(backend="aot_eager", dynamic=False)
        ddp.train()
        with torch._dynamo.config.patch(error_on_recompile=compiled):
            for _ in range(2):
                clear_aux_losses_tracker()
                ddp.zero_grad_buffer()
                for ids in batches:
                    ddp(ids, pos, None, labels=ids).mean().backward()
                ddp.finish_grad_sync()
        tracked = {k: v["values"].clone() for k, v in get_moe_layer_wise_logging_tracker().items()}
        runs.append(({n: p.main_grad.clone() for n, p in model.named_parameters()}, tracked))
        if compiled:
            breaks = " ".join(torch._dynamo.utils.counters["graph_break"])  # (on the CPU: its shims' few)
            for what in ("experts", "apply", "z_loss", "disable", "Higher Order", "__build_class__", "mul"):
                assert what not in breaks, breaks
    (ga, ta), (gb, tb) = runs
    assert any("local_experts" in n for n in ga) and ga.keys() == gb.keys()
    for n in ga:
        assert ga[n].abs().sum() > 0, n
        assert torch.allclose(ga[n], gb[n], rtol=1e-5, atol=1e-7), n
    assert ta.keys() == tb.keys() == {"load_balancing_loss", "z_loss"}
    assert all(torch.allclose(ta[k], tb[k], rtol=1e-5) and ta[k].all() for k in ta)
