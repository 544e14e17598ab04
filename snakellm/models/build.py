"""Build a megatron-core ``GPTModel`` from a resolved architecture.

Layer spec: Transformer Engine's when ``transformer_engine`` imports and we run
on CUDA (cluster containers); otherwise megatron-core's local spec with its core
attention replaced by :class:`snakellm.models.attention` 's SDPA class (flash /
cuDNN kernels on a GPU, no [b, h, s, s] score tensor anywhere).

Sequence parallelism with the local spec: megatron-core's torch norm wrapper
(``WrappedTorchNorm``, used when apex is absent) refuses it, although a norm is
per token and computes the same on a slice of the sequence. What sequence
parallelism needs from a norm is only that its parameters are marked
``sequence_parallel``, so that their gradients (each tensor-parallel rank saw
other tokens) are summed over the tensor-parallel group after the backward pass
(``megatron.core.distributed.finalize_model_grads``). :func:`_norm_class` does
that with the same torch modules, so the checkpoint keys do not change.
"""

from __future__ import annotations

from typing import Any

from snakellm.models import families, moe
from snakellm.models.architecture import ModelConfigError
from snakellm.models.attention import sdpa_attention_class
from snakellm.models.loss import cross_entropy, vocab_parallel_cross_entropy


def have_transformer_engine() -> bool:
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def build_model(
    cfg: dict[str, Any],
    vocab: int,
    *,
    tp: int = 1,
    device: str = "cpu",
    bf16: bool = False,
    fused_loss: str = "auto",
    compile_layers: bool = False,
    use_te: bool | None = None,
    attention_backend: str = "auto",
    sequence_parallel: bool = False,
    vp_stage: int | None = None,
    recompute: str = "none",
    recompute_method: str = "uniform",
    recompute_num_layers: int = 1,
    seed: int | None = None,
    fp8: str | None = None,
    moe_experts: str = "grouped",
):
    """Build a megatron-core GPTModel (model-parallel state must be initialised).

    Under pipeline parallelism (megatron-core's parallel state says its size) this is the
    rank's stage, or with virtual stages its chunk ``vp_stage``: the embedding on the first,
    the final norm and output layer on the last, the layers in between; their checkpoint keys
    are the global layer numbers, so a checkpoint loads at any other layout. ``recompute``:
    megatron-core's activation recomputation, ``selective`` (core attention) or ``full``
    (whole layers, ``recompute_method`` uniform|block over ``recompute_num_layers``).
    ``seed``: initialise the weights by :func:`init_weights` (the same whatever the layout).

    ``vocab`` is the padded vocabulary size. ``fused_loss``: "auto" (the compiled
    loss on CUDA, eager on the CPU), "compiled", "eager" (the same math uncompiled;
    both vocabulary-parallel at TP > 1) or "megatron" (megatron-core's own
    vocab-parallel cross-entropy). ``sequence_parallel`` needs ``tp > 1``. ``fp8``: a
    recipe of :mod:`snakellm.models.fp8` ("tensorwise" | "rowwise"): the block
    linears' matmuls in float8 (needs ``bf16``; Transformer Engine's FP8 with its spec).
    ``moe_experts`` (a mixture of experts, local spec): "grouped" (:func:`snakellm.models.moe.grouped_experts_class`:
    the local experts as two grouped matrix products) or "sequential" (megatron-core's SequentialMLP loop);
    the parameters and checkpoints are the same.
    """
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from snakellm.launch.runtime import cpu_tensor_cuda

    if sequence_parallel and tp == 1:
        raise ModelConfigError("sequence parallelism needs tensor parallel size > 1")
    cuda = device.startswith("cuda")
    if use_te is None:
        use_te = cuda and have_transformer_engine()
    if fp8:
        from snakellm.models import fp8 as fp8mod

        _check_fp8(torch, device, bf16)
    family = families.get(cfg["style"])
    recompute_args = _recompute_args(recompute, recompute_method, recompute_num_layers)
    tcfg = _transformer_config(
        cfg,
        family,
        tp=tp,
        cuda=cuda,
        bf16=bf16,
        sequence_parallel=sequence_parallel,
        extra={**recompute_args, **(fp8mod.te_config(fp8) if fp8 and use_te else {})},
    )
    layers = _layer_spec(
        cfg,
        tcfg,
        vp_stage,
        use_te=use_te,
        attention_backend=attention_backend,
        sequence_parallel=sequence_parallel,
        moe_experts=moe_experts,
    )
    SnakeGPTModel = _model_class(GPTModel, _loss_function(fused_loss, cuda=cuda, tp=tp))
    model_args: dict[str, Any] = dict(
        config=tcfg,
        transformer_layer_spec=layers,
        vocab_size=vocab,
        max_sequence_length=cfg["seq_length"],
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg["tie_embeddings"],
        position_embedding_type="learned_absolute" if cfg["position_embedding"] == "learned" else "rope",
        rotary_base=cfg["rotary_base"],
    )
    model_args.update(family.megatron_model(cfg))  # e.g. rope scaling
    with cpu_tensor_cuda(cuda):  # tied embeddings under pipeline parallelism: the last stage's copy
        model = SnakeGPTModel(**model_args)
    if seed is not None:
        init_weights(model, tcfg, seed)
    _place(model, cfg, family, bf16=bf16, cuda=cuda)
    _finish(model, cfg, moe_experts=moe_experts, fp8=fp8 if not use_te else None, compile_layers=compile_layers)
    return model, tcfg


def _model_class(gpt_model: Any, loss_fn: Any) -> Any:
    """megatron-core's GPTModel with snakellm's loss (None: megatron-core's own)."""

    class SnakeGPTModel(gpt_model):
        def compute_language_model_loss(self, labels, logits):
            if loss_fn is None:
                return super().compute_language_model_loss(labels, logits)
            return loss_fn(logits, labels)

    return SnakeGPTModel


def _check_fp8(torch: Any, device: str, bf16: bool) -> None:
    from snakellm.models import fp8 as fp8mod

    fp8mod.check_device(torch, device)
    if not bf16:
        raise ModelConfigError("precision: fp8 keeps bf16 weights: build with bf16=True")


def _finish(model: Any, cfg: dict[str, Any], *, moe_experts: str, fp8: str | None, compile_layers: bool) -> None:
    """After the weights are placed: the experts packed, the float8 matmuls (torchao, without TE), compilation."""
    if cfg.get("num_experts") and moe_experts == "grouped":
        moe.one_rank_dispatch_where_grouped(model)  # first: it sets the order of the experts' tokens
        moe.pack_experts(model)  # one storage per layer's experts in that order: the products read it as it is
    if fp8:
        from snakellm.models import fp8 as fp8mod

        fp8mod.convert(model, fp8)  # the block linears' matmuls in float8 (torchao), before compilation
    if compile_layers:
        compile_each_layer(model.decoder.layers)


def compile_each_layer(layers: Any) -> None:
    """``torch.compile`` each transformer layer (static shapes), whole: see :func:`pass_tp_group`; what of a
    mixture of experts' MLP stays eager inside it: :func:`eager_moe`."""
    pass_tp_group()
    for layer in layers:
        eager_moe(layer)
        layer.compile(dynamic=False)


def eager_moe(layer: Any) -> None:
    """What of a mixture-of-experts layer's MLP runs eagerly inside its compiled layer.

    Where the token dispatcher waits for nothing (one rank, :func:`snakellm.models.moe.one_rank_dispatch`),
    none of it: the router, the dispatch and the grouped experts compile with the layer, the experts as an
    operator opaque to the compiler where DDP's buffers take their gradients (:func:`snakellm.models.moe.
    buffer_ops`; elsewhere they are a graph break: their eager backward writes into DDP's buffers), and
    the router's aux-loss and z-loss bookkeeping traced without the layer's number as a constant
    (:func:`snakellm.models.moe.trace_aux_losses`; megatron-core's recompiled once a layer, past Dynamo's
    limit of 8).

    Elsewhere the whole MLP (router, token dispatcher, experts) is eager: megatron-core's alltoall
    dispatcher copies the split sizes to the host on a side stream and calls ``Tensor.record_stream``,
    which Dynamo cannot functionalise (the layer failed to compile on an H200), and with its steps as graph
    breaks each layer's MLP was about 30 compiled regions whose guards and wrappers cost more host time
    than the eager operations they replace (7.3 ms of host time a layer's forward against 4.7 eager at
    Qwen3-30B-A3B's shape on one H200).
    """
    import torch

    mlp: Any = getattr(layer, "mlp", None)
    dispatcher = getattr(mlp, "token_dispatcher", None)
    if dispatcher is None or getattr(mlp.forward, "_torchdynamo_disable", False):
        return
    if not getattr(dispatcher, "waits_for_nothing", False):
        mlp.forward = torch.compiler.disable(mlp.forward)
        return
    if moe.trace_aux_losses(mlp.router):
        return
    for name in ("attach_and_log_load_balancing_loss", "apply_z_loss"):
        step = getattr(mlp.router, name, None)
        if step is not None and not getattr(step, "_torchdynamo_disable", False):
            setattr(mlp.router, name, torch.compiler.disable(step))


def pass_tp_group() -> None:
    """Hand megatron-core's tensor-parallel helpers the group where its own callers pass none.

    megatron-core 0.16.1's row-parallel linear calls its matmul helpers with ``tp_group=None``;
    ``get_tensor_model_parallel_group_if_none`` then warns (a deprecation, on rank 0 only) on every
    call before it looks the group up. Dynamo cannot trace that ``warnings.warn``: a compiled layer
    broke there, inside megatron-core's offloading context manager, where it cannot resume, so the
    rest of each layer's forward ran uncompiled, on rank 0 alone (the other ranks waiting for it at
    every collective). The wrapper looks the group up first, as the function itself would, so the
    warning's branch is never taken; everything else is megatron-core's function.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import utils
    from megatron.core.tensor_parallel import layers, mappings

    original = utils.get_tensor_model_parallel_group_if_none

    def with_group(tp_group: Any, is_expert: bool = False, check_initialized: bool = True) -> Any:
        if tp_group is None and not is_expert and ps.is_initialized():
            tp_group = ps.get_tensor_model_parallel_group(check_initialized=check_initialized)
        return original(tp_group, is_expert=is_expert, check_initialized=check_initialized)

    for mod in (layers, mappings):
        if getattr(mod.get_tensor_model_parallel_group_if_none, "__wrapped__", None) is None:
            with_group.__wrapped__ = original  # type: ignore[attr-defined]
            mod.get_tensor_model_parallel_group_if_none = with_group


def _recompute_args(recompute: str, method: str, num_layers: int) -> dict[str, Any]:
    """megatron-core's TransformerConfig arguments of activation recomputation (none: nothing)."""
    if recompute == "none":
        return {}
    if recompute == "selective":
        return {"recompute_granularity": recompute}
    return {"recompute_granularity": recompute, "recompute_method": method, "recompute_num_layers": num_layers}


def _place(model: Any, cfg: dict[str, Any], family: families.Family, *, bf16: bool, cuda: bool) -> None:
    """The family's RoPE frequencies, the dtype and the device of a freshly built model."""
    import torch

    rot = getattr(model, "rotary_pos_emb", None)
    if rot is not None:
        # the family's frequencies (Llama 3.x's scaling with any of its values; megatron-core's own
        # rope_scaling takes the factor only), set before the first forward (its embeddings are cached)
        rot.inv_freq = family.rope_inv_freq(cfg, families.head_dim(cfg), rot.inv_freq.device)
    if bf16:
        # what Megatron-LM's Float16Module does: every parameter in bf16, norms included
        # (torch's LayerNorm/RMSNorm are created in fp32 whatever params_dtype says)
        model.bfloat16()
    if cuda:
        model.cuda(torch.cuda.current_device())


def _transformer_config(
    cfg: dict[str, Any],
    family: families.Family,
    *,
    tp: int,
    cuda: bool,
    bf16: bool,
    sequence_parallel: bool,
    extra: dict[str, Any] | None = None,
) -> Any:
    """megatron-core's TransformerConfig for the architecture (plus the family's and the caller's arguments)."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    swiglu = cfg["activation"] == "swiglu"
    args: dict[str, Any] = dict(
        num_layers=cfg["num_layers"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg["num_query_groups"],
        ffn_hidden_size=cfg["ffn_hidden_size"],
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        sequence_parallel=sequence_parallel,
        normalization=cfg["normalization"],
        layernorm_epsilon=cfg["layernorm_epsilon"],
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=cfg["bias"],
        add_qkv_bias=cfg["bias"],
        hidden_dropout=cfg["hidden_dropout"],
        attention_dropout=cfg["attention_dropout"],
        init_method_std=cfg["init_method_std"],
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=not cuda,
        # megatron-core's fusions are torch.compile'd: worth it on a GPU, a
        # minute of compile time for nothing on the CPU. The fused SwiGLU
        # (bias_swiglu_impl) keeps only its input for the backward pass, not
        # SiLU(gate) as well: an f-wide tensor less per layer (7 GiB at 8B and
        # sequence 8192) and two kernels instead of five
        bias_activation_fusion=cuda and (swiglu or cfg["bias"]),
        bias_dropout_fusion=cuda,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
    )
    args.update(moe.megatron_config(cfg, ps.get_expert_model_parallel_world_size()))  # MoE layers (none: {})
    args.update(family.megatron_config(cfg))  # the family's own (and overriding) arguments, e.g. add_qkv_bias
    args.update(extra or {})  # activation recomputation, Transformer Engine's FP8 recipe
    return TransformerConfig(**args)


def _layer_spec(
    cfg: dict[str, Any],
    tcfg: Any,
    vp_stage: int | None,
    *,
    use_te: bool,
    attention_backend: str,
    sequence_parallel: bool,
    moe_experts: str = "grouped",
) -> Any:
    """Transformer Engine's layer spec, or the local one with SDPA core attention (and SP-ready norms)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    qk = bool(tcfg.qk_layernorm)  # the family's QK-norm (Qwen3): q_layernorm and k_layernorm over each head
    experts = cfg.get("num_experts") or None  # megatron-core's MoE layer as every layer's MLP
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts,
            moe_grouped_gemm=experts is not None,
            normalization=cfg["normalization"],
            qk_layernorm=qk,
        )
    spec = get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, normalization=cfg["normalization"], qk_layernorm=qk
    )
    spec.submodules.self_attention.submodules.core_attention = sdpa_attention_class(attention_backend)
    if experts is not None and moe_experts == "grouped":
        spec.submodules.mlp.submodules.experts.module = moe.grouped_experts_class()
    elif moe_experts not in ("grouped", "sequential"):
        raise ModelConfigError(f"moe_experts must be grouped or sequential, got {moe_experts!r}")
    if not sequence_parallel:
        return spec
    norm = _norm_class()
    spec.submodules.input_layernorm = norm
    spec.submodules.pre_mlp_layernorm = norm
    if qk:  # per head, inside the tensor-parallel region: megatron-core sums their gradients over tp itself
        spec.submodules.self_attention.submodules.q_layernorm = norm
        spec.submodules.self_attention.submodules.k_layernorm = norm
    # this stage's (or chunk's) layers: a block spec lists exactly the layers it builds
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(tcfg, vp_stage), layer_norm=norm)


def _loss_function(fused_loss: str, *, cuda: bool, tp: int) -> Any:
    """The cross-entropy the model's loss uses; None: megatron-core's own (vocab-parallel).

    At tp > 1 "compiled" and "eager" are :func:`snakellm.models.loss.vocab_parallel_cross_entropy`
    (the logits are split over the vocabulary), compiled or not.
    """
    import functools

    import torch

    if fused_loss == "auto":
        fused_loss = "compiled" if cuda else "eager"
    if fused_loss not in ("compiled", "eager", "megatron"):
        raise ModelConfigError(f"unknown loss implementation {fused_loss!r}")
    if fused_loss == "megatron":
        return None
    if tp > 1:
        return functools.partial(vocab_parallel_cross_entropy, compiled=fused_loss == "compiled")
    if fused_loss == "compiled":
        return torch.compile(cross_entropy, dynamic=False)
    return cross_entropy


def _norm_class() -> Any:
    """torch's LayerNorm/RMSNorm, as megatron-core's ``WrappedTorchNorm`` builds them, usable with sequence
    parallelism: the parameters carry ``sequence_parallel`` (see the module docstring)."""
    import torch

    class SequenceParallelTorchNorm:
        def __new__(
            cls,
            config: Any,
            hidden_size: int,
            eps: float = 1e-5,
            persist_layer_norm: bool = False,
            zero_centered_gamma: bool = False,
            normalization: str = "LayerNorm",
        ) -> Any:
            kind = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
            norm = kind(normalized_shape=hidden_size, eps=eps)
            for p in norm.parameters():
                p.sequence_parallel = config.sequence_parallel
            return norm

    return SequenceParallelTorchNorm


def init_weights(model: Any, tcfg: Any, seed: int) -> None:
    """Initialise every weight matrix the same way whatever the tensor/pipeline layout (megatron-core's
    distributions: normal(0, init_method_std), the output projections' std / sqrt(2 num_layers)).

    megatron-core draws each rank's weights from that rank's generator, so a model split in two pipeline
    stages starts from other weights than the whole one (and on GPUs a tensor-parallel one too). Here
    each weight of each layer is drawn whole from a generator seeded by ``seed``, its checkpoint key and
    its global layer number, and the rank keeps its slice (the checkpoint's sharding says which): the
    same model at any tp x pp x virtual_pp, so that the layouts give the same losses. Biases and norms
    keep their constant initial values.
    """
    import hashlib
    import math

    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model.sharded_state_dict())
    shards: list[Any] = []
    for t in nested_values(tensors):
        if isinstance(t, ShardedTensorFactory):
            built = t.build()
            shards += (
                [x for x in nested_values(built) if isinstance(x, ShardedTensor)]
                if isinstance(built, (dict, list))
                else [built]
            )
        else:
            shards.append(t)
    std = tcfg.init_method_std
    scaled = std / math.sqrt(2.0 * tcfg.num_layers)
    with torch.no_grad():
        for t in shards:
            if t.data.dim() < 2 or not t.key.endswith("weight"):
                continue
            lead = t.prepend_axis_num
            layer = t.global_offset[:lead]
            shape = t.global_shape[lead:]
            sd = scaled if t.key.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
            digest = hashlib.sha256(f"{seed}/{t.key}/{layer}".encode()).hexdigest()
            gen = torch.Generator(device=t.data.device).manual_seed(int(digest[:15], 16))
            full = torch.empty(shape, dtype=torch.float32, device=t.data.device).normal_(0.0, sd, generator=gen)
            index = tuple(slice(o, o + n) for o, n in zip(t.global_offset[lead:], t.local_shape))
            t.data.copy_(full[index])
