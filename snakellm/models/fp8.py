"""FP8 training matmuls: torchao's float8 inside megatron-core's column- and row-parallel linears.

``precision: fp8`` keeps every weight, gradient and optimizer state as
``bf16`` does (bf16 weights, fp32 main gradients and Adam states, so
checkpoints, ``.nemo`` and Hugging Face exports are those of a bf16 run) and
runs the matmuls of the transformer blocks' four linears (``linear_qkv``,
``linear_proj``, ``linear_fc1``, ``linear_fc2``) in float8: each operand is
cast with a dynamic scale (``tensorwise``: one per tensor, e4m3 forward and e5m2
gradients, cuBLAS's kernel; ``rowwise``: one per row, e4m3 throughout, scales
rounded to powers of two) and multiplied by ``torch._scaled_mm`` with a bf16
result. The embedding, the output layer, the norms and attention stay bf16.

megatron-core's ``ColumnParallelLinear``/``RowParallelLinear`` are not
``nn.Linear``, so torchao's module swap (``convert_to_float8_training``) does
not reach them. Their ``forward`` hands the matmul to ``self._forward_impl``
with the tensor-parallel plan (sequence-parallel all-gather, input-gradient
all-reduce); :func:`convert` replaces that one method on each block linear by
:class:`Float8Matmul`, which does the same communication with megatron-core's
own autograd mappings (all-gather forward / reduce-scatter backward under
sequence parallelism, identity / all-reduce otherwise) around torchao's float8
matmul (``matmul_with_hp_or_float8_args``, what ``Float8Linear.forward``
calls). So it composes with tensor and sequence parallelism, DDP and the
distributed optimizer unchanged: the weight's gradient is an ordinary bf16
``.grad`` that megatron-core's DDP hook adds to the fp32 main gradient. A frozen
weight (LoRA's base) takes a float8 matmul that skips the weight gradient.

Where Transformer Engine imports (cluster containers), the model uses TE's
layer spec and TE's own FP8 (:func:`te_config`); that path cannot run here
and is not tested. FP8 tensor cores need compute capability 8.9 (Ada, Hopper
and later): :func:`check_device` refuses anything else, naming the setting.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from snakellm.models.architecture import ModelConfigError

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)
# tests only: let check_device pass on the CPU (torch's CPU _scaled_mm computes float8 matmuls too)
ANY_DEVICE_ENV = "SNAKELLM_FP8_ANY_DEVICE"
BLOCK_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# TE's recipe for ours: current (per-tensor) scaling; TE has no row-wise recipe, its 1x128 blocks come closest
TE_RECIPES = {"tensorwise": "tensorwise", "rowwise": "blockwise"}


class FP8Error(ModelConfigError):
    """``precision: fp8`` where it cannot run (no FP8 tensor cores, shapes float8 kernels refuse)."""


def check_device(torch: Any, device: Any) -> None:
    """Refuse ``precision: fp8`` on the CPU and on GPUs before compute capability 8.9, naming the setting."""
    if os.environ.get(ANY_DEVICE_ENV) == "1":
        return
    if not str(device).startswith("cuda"):
        check_capability(None, "the CPU")
    else:
        check_capability(tuple(torch.cuda.get_device_capability(device)), torch.cuda.get_device_name(device))


def check_capability(capability: tuple[int, int] | None, name: str) -> None:
    """FP8Error unless ``capability`` (a GPU's compute capability; None: the CPU) has FP8 tensor cores."""
    if capability is not None and tuple(capability) >= MIN_CAPABILITY:
        return
    need = f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
    has = "runs on the CPU" if capability is None else f"has compute capability {capability[0]}.{capability[1]}"
    raise FP8Error(
        f"precision: fp8 (--precision fp8) needs an NVIDIA GPU with FP8 tensor cores, compute capability {need} "
        f"or newer (Ada, Hopper, Blackwell); this job {has} ({name}): set precision: bf16 (--precision bf16)"
    )


def te_config(recipe: str) -> dict[str, Any]:
    """megatron-core TransformerConfig arguments for Transformer Engine's FP8 (e4m3 forward, e5m2 gradients)."""
    return {"fp8": "hybrid", "fp8_recipe": TE_RECIPES[recipe]}


def block_linears(model: Any) -> list[tuple[str, Any]]:
    """(name, module) of the four linears of every transformer layer: what runs in float8."""
    out = []
    for i, layer in enumerate(model.decoder.layers):
        for parent_name in ("self_attention", "mlp"):
            parent = getattr(layer, parent_name)
            for kind in BLOCK_LINEARS:
                lin = getattr(parent, kind, None)
                if lin is not None:
                    out.append((f"decoder.layers.{i}.{parent_name}.{kind}", lin))
    return out


def float8_config(recipe: str) -> Any:
    """torchao's Float8LinearConfig for ``recipe`` (the same configs ``convert_to_float8_training`` takes)."""
    if recipe not in RECIPES:
        raise FP8Error(f"fp8_recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    Float8LinearConfig, _, _ = _torchao()
    return Float8LinearConfig.from_recipe_name(recipe)


def convert(model: Any, recipe: str = "tensorwise") -> int:
    """Run the matmuls of ``model``'s block linears in float8 (in place); returns how many were converted.

    The parameters, their names and the state dict do not change. float8 kernels
    need both dimensions of every weight (this rank's shard) to be multiples of 16:
    a shape that is not is refused with the layer's name.
    """
    config = float8_config(recipe)
    linears = block_linears(model)
    for name, lin in linears:
        if lin.weight is None:
            raise FP8Error(f"{name}: the weight is passed at call time (skip_weight_param_allocation): not supported")
        out_f, in_f = lin.weight.shape
        if out_f % 16 or in_f % 16:
            raise FP8Error(
                f"precision: fp8: {name} has a {out_f} x {in_f} weight on this rank; float8 matmuls need both "
                "dimensions to be multiples of 16 (choose hidden, ffn and head sizes that are)"
            )
        lin._forward_impl = Float8Matmul(config)
    _patch_inductor()
    return len(linears)


def is_converted(module: Any) -> bool:
    return isinstance(getattr(module, "_forward_impl", None), Float8Matmul)


class Float8Matmul:
    """A megatron-core linear's ``_forward_impl`` with the matmul in float8 (see the module docstring)."""

    def __init__(self, config: Any):
        from megatron.core.tensor_parallel import mappings
        from megatron.core.utils import get_tensor_model_parallel_group_if_none
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        self.config = config
        # what Float8Linear builds: fast accumulation for the forward GEMM only
        self.mm_config = LinearMMConfig(
            *(
                ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, config.pad_inner_dim)
                for gemm in (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
            )
        )
        # resolved once here: the call runs inside torch.compile'd layers
        self._matmul = matmul_with_hp_or_float8_args
        self._frozen = _frozen_matmul()
        self._gather = mappings.gather_from_sequence_parallel_region
        self._copy = mappings.copy_to_tensor_model_parallel_region
        self._group = get_tensor_model_parallel_group_if_none

    def __repr__(self) -> str:
        c = self.config
        return f"Float8Matmul(input={c.cast_config_input.short_str()}, weight={c.cast_config_weight.short_str()})"

    def __call__(
        self,
        input: Any,
        weight: Any,
        bias: Any,
        gradient_accumulation_fusion: bool = False,
        allreduce_dgrad: bool = False,
        sequence_parallel: bool = False,
        grad_output_buffer: Any = None,
        wgrad_deferral_limit: Any = None,
        tp_group: Any = None,
        **unused: Any,
    ) -> Any:
        if gradient_accumulation_fusion or grad_output_buffer is not None:
            raise FP8Error("precision: fp8 does not support gradient accumulation fusion or deferred weight gradients")
        if sequence_parallel:  # all-gather the sequence; its backward reduce-scatters the input gradient
            input = self._gather(input, tensor_parallel_output_grad=True, group=self._group(tp_group))
        elif allreduce_dgrad:  # identity; its backward all-reduces the input gradient over the TP ranks
            input = self._copy(input, group=self._group(tp_group))
        import torch

        # a frozen weight (LoRA's base): the matmul without a weight gradient
        matmul, fn = (_trained_mm, self._matmul) if weight.requires_grad else (_frozen_mm, self._frozen)
        if input.is_cuda and not torch.compiler.is_compiling():
            # torchao's casts run eagerly as 5-6 kernels each (4,859 tokens/s/GPU at 8B on H100s, 0.57x bf16):
            # compiled, each is one fused kernel; inside a --compile'd layer the layer's graph takes them in
            matmul = _compiled(matmul)
        out = matmul(fn, input, weight, self.mm_config, self.config)
        return out + bias if bias is not None else out


def _trained_mm(fn: Any, x: Any, w: Any, mm: Any, config: Any) -> Any:
    """torchao's float8 ``x @ w.t()`` (``fn``: matmul_with_hp_or_float8_args, as Float8Linear calls it)."""
    return fn.apply(x, w.t(), mm, config)


def _frozen_mm(fn: Any, x: Any, w: Any, mm: Any, config: Any) -> Any:
    """The same for a frozen weight (``fn``: :func:`_frozen_matmul`'s, which takes ``w`` untransposed)."""
    return fn.apply(x, w, mm, config)


_COMPILED: dict[Any, Any] = {}


def _compiled(fn: Any) -> Any:
    """``fn`` under torch.compile (static shapes: one graph per linear's shape, with and without grad)."""
    if fn not in _COMPILED:
        import torch

        # 4 linear shapes x (grad, no grad: recomputed layers) x (trained, frozen) graphs per function
        cfg = torch._dynamo.config
        name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        setattr(cfg, name, max(getattr(cfg, name), 32))
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


_FROZEN: Any = None


def _frozen_matmul() -> Any:
    """float8 ``input @ weight.t()`` whose backward gives the input gradient only (a frozen base weight)."""
    global _FROZEN
    if _FROZEN is not None:
        return _FROZEN
    import torch
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    def cast(t: Any, cc: Any, mm: Any, role: Any, dim: int, config: Any) -> Any:
        return hp_tensor_to_float8_dynamic(
            t,
            cc.target_dtype,
            mm,
            gemm_input_role=role,
            scaling_granularity=cc.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(dim, cc.scaling_granularity),
            round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        )

    class FrozenFloat8Matmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, w: Any, mm: Any, config: Any) -> Any:
            ctx.save_for_backward(w)
            ctx.mm, ctx.config = mm, config
            shape = x.shape
            x8 = cast(x.reshape(-1, shape[-1]), config.cast_config_input, mm, GemmInputRole.INPUT, -1, config)
            w8 = cast(w.t(), config.cast_config_weight, mm, GemmInputRole.WEIGHT, 0, config)
            out = torch.mm(x8, w8)
            return out.reshape(*shape[:-1], out.shape[-1])

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            (w,) = ctx.saved_tensors
            mm, config = ctx.mm, ctx.config
            shape = grad.shape
            g8 = cast(
                grad.reshape(-1, shape[-1]), config.cast_config_grad_output, mm, GemmInputRole.GRAD_OUTPUT, -1, config
            )
            w8 = cast(w.t(), config.cast_config_weight_for_grad_input, mm, GemmInputRole.WEIGHT, -1, config)
            gi = torch.mm(g8, w8.t())
            return gi.reshape(*shape[:-1], gi.shape[-1]), None, None, None

    _FROZEN = torch._dynamo.allow_in_graph(FrozenFloat8Matmul)
    return _FROZEN


# ----------------------------------------------------------------------------- FSDP's float8 all-gather


def all_gather_conflict(fp8_all_gather: bool, precision: str, recipe: str) -> str | None:
    """Why ``parallel.fp8_all_gather`` cannot run with this precision and recipe (None: it can)."""
    if not fp8_all_gather:
        return None
    if precision != "fp8":
        return f"gathers float8 weights: it needs precision fp8 (got {precision})"
    if recipe != "tensorwise":
        return f"casts each shard with one scale per weight: it needs fp8_recipe tensorwise (got {recipe})"
    return None


def float8_all_gather(module: Any) -> int:
    """Let FSDP2 all-gather the converted block linears' weights in float8 (before ``fully_shard``; in place).

    Each weight becomes torchao's ``WeightWithDynamicFloat8CastTensor`` around the same (fp32 master) tensor:
    FSDP's pre-all-gather hook casts the rank's shard with the weight's scale and gathers the float8 bytes, and
    the linear receives a ``Float8TrainingTensor``, which torchao's matmul takes as it is, forward and backward
    (tensorwise: one scale serves both). Megatron-core's attributes of each parameter are kept. Returns how
    many weights were wrapped.
    """
    import torch
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    n = 0
    for _, lin in block_linears(module):
        impl = getattr(lin, "_forward_impl", None)
        if not isinstance(impl, Float8Matmul):
            continue
        old = lin.weight
        target = impl.config.cast_config_weight.target_dtype
        new = torch.nn.Parameter(
            WeightWithDynamicFloat8CastTensor(old.data, impl.mm_config, target), requires_grad=old.requires_grad
        )
        new.__dict__.update(old.__dict__)  # tensor_model_parallel, partition_dim, ...
        lin.weight = new
        n += 1
    if n:
        _fuse_pre_all_gather_cast()
    return n


def weight_cast(shard: Any, scale: Any, dtype: Any) -> Any:
    """The float8 bytes of an fp32 weight shard at its precomputed scale: torchao's cast (``_ToFloat8ConstrFunc``:
    its own ``to_fp8_saturated(tensor.float() * scale)``), without the tensor subclass around the result."""
    import torch
    from torchao.float8.float8_utils import to_fp8_saturated

    return to_fp8_saturated(shard.to(torch.float32) * scale, dtype)


def _fuse_pre_all_gather_cast() -> None:
    """Run torchao's pre-all-gather cast of the float8-gathered weights as one compiled kernel on CUDA.

    ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`` runs in FSDP's hook, outside the compiled layers,
    and casts each fp32 shard eagerly: a multiply, a clamp and a conversion, each a pass over the shard (at 8B
    on 4 H200s, 504 launches of each and 89 ms of kernel time a step, on the copy-in stream beside the matrix
    products). With a precomputed scale (always, here: :func:`precompute_all_gather_scales`) the method now
    takes :func:`weight_cast` compiled: one read of the shard, one write of its float8 bytes, the same bytes.
    Installed once, on torchao's class, by :func:`float8_all_gather` (the CPU runs :func:`weight_cast` uncompiled).
    """
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as W

    original = W.fsdp_pre_all_gather
    if getattr(original, "_snakellm", False):
        return

    def fsdp_pre_all_gather(self: Any, mesh: Any) -> Any:
        scale = self._precomputed_scale
        if scale is None:
            return original(self, mesh)
        cast = _compiled(weight_cast) if self._tensor.is_cuda else weight_cast
        return (cast(self._tensor, scale, self._dtype),), (scale,)

    fsdp_pre_all_gather._snakellm = True  # type: ignore[attr-defined]
    W.fsdp_pre_all_gather = fsdp_pre_all_gather


def precompute_all_gather_scales(module: Any) -> None:
    """Every float8-gathered weight's scale from its amax over all shards, in one all-reduce (after each
    optimizer step and each load; torchao's ``precompute_float8_dynamic_scale_for_fsdp`` does the same for
    its own ``Float8Linear`` modules only). Without it each gather would all-reduce its own amax."""
    import math

    import torch
    from torchao.float8.float8_utils import EPS
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    weights = [
        lin.weight
        for _, lin in block_linears(module)
        if isinstance(getattr(lin.weight, "_local_tensor", None), WeightWithDynamicFloat8CastTensor)
    ]
    if not weights:
        return
    with torch.no_grad():
        amax = torch.clamp(torch.stack(torch._foreach_norm(weights, ord=math.inf)), EPS)  # one all-reduce
        fmax = torch.finfo(weights[0]._local_tensor._dtype).max
        scale: Any = fmax / amax.to(torch.float64)  # a replicated DTensor, as torchao's amax_to_scale
        scales = scale.to_local().to(torch.float32)
    for w, scale in zip(weights, scales, strict=True):
        w._local_tensor._precomputed_scale = scale


def _torchao() -> tuple[Any, Any, Any]:
    """torchao's float8 pieces, imported quietly (its C++ extensions for other recipes log when they cannot load)."""
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        from torchao.float8.config import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    except ImportError as e:
        raise FP8Error(
            f"precision: fp8 needs torchao, a dependency of snakellm (pip install torchao==0.18.0): {e}"
        ) from None
    finally:
        for q, lv in zip(quiet, levels, strict=True):
            q.setLevel(lv)
    return Float8LinearConfig, Float8Linear, matmul_with_hp_or_float8_args


def _patch_inductor() -> None:
    """torchao's workaround for a Triton miscompile of compiled float8 kernels (what convert_to_float8_training
    applies before it swaps modules)."""
    try:
        from torchao.float8._inductor_patch import _patch_inductor_min_max_codegen
    except ImportError:
        return
    _patch_inductor_min_max_codegen()


def trajectory(precision: str, recipe: str) -> dict[str, Any]:
    """The precision as it enters a run's fingerprint: the fp8 recipe only with fp8 (bf16 and fp32 runs keep the
    fingerprints they had before fp8 existed)."""
    return {"precision": precision} | ({"fp8_recipe": recipe} if precision == "fp8" else {})


def check_request(precision: str, device: str, arch: dict[str, Any] | None = None, tp: int = 1) -> None:
    """Refuse ``precision: fp8`` with ``--device cpu`` or with shapes float8 kernels refuse, before anything
    starts (torch-free; the GPU's compute capability is checked when the model is built)."""
    if precision != "fp8":
        return
    if device == "cpu":
        check_device(None, "cpu")
    if arch is not None:
        check_shapes(arch, tp)


def weight_shapes(arch: dict[str, Any], tp: int = 1) -> dict[str, tuple[int, int]]:
    """(out, in) of each block linear's weight on one tensor-parallel rank."""
    h, heads = arch["hidden_size"], arch["num_attention_heads"]
    groups = arch.get("num_query_groups") or heads
    kv_channels = arch.get("kv_channels") or h // heads
    ffn = arch["ffn_hidden_size"]
    fc1 = ffn * (2 if arch.get("activation") == "swiglu" else 1)
    return {
        "linear_qkv": ((heads + 2 * groups) * kv_channels // tp, h),
        "linear_proj": (h, heads * kv_channels // tp),
        "linear_fc1": (fc1 // tp, h),
        "linear_fc2": (h, ffn // tp),
    }


def check_shapes(arch: dict[str, Any], tp: int = 1) -> None:
    """float8 matmuls need both dimensions of every weight (one rank's shard) to be multiples of 16."""
    for name, (out_f, in_f) in weight_shapes(arch, tp).items():
        if out_f % 16 or in_f % 16:
            raise FP8Error(
                f"precision: fp8: {name} has a {out_f} x {in_f} weight on each of the {tp} tensor-parallel "
                "rank(s); float8 matmuls need both dimensions to be multiples of 16 (choose hidden, ffn and head "
                "sizes that are)"
            )
