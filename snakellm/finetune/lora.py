"""LoRA on megatron-core's linear layers, with NeMo's options, tensor-parallel aware.

``y = W x + (alpha / r) * B A dropout(x)`` on any of the transformer layers'
``linear_qkv``, ``linear_proj`` (attention) and ``linear_fc1``, ``linear_fc2``
(MLP), in the layers chosen. As NeMo's ``ParallelLinearAdapter``: ``A``
(``linear_in``) is initialised by ``column_init`` (xavier by default), ``B``
(``linear_out``) by ``row_init`` (zero), so training starts from the base
model's exact outputs; ``alpha`` defaults to the rank (scale 1).

Tensor parallelism follows the base layer's split:

* column-parallel layers (``linear_qkv``, ``linear_fc1``: full input, output
  split over ranks): ``A`` replicated, ``B`` split by output rows; the gradient
  reaching ``A`` is summed over ranks (``copy_to_tensor_model_parallel_region``).
* row-parallel layers (``linear_proj``, ``linear_fc2``: input split): ``A``
  split by input columns, its partial products summed over ranks
  (``reduce_from_tensor_model_parallel_region``), ``B`` replicated.

So ``B_shard @ A`` (column) or ``B @ A_shard`` (row) is exactly this rank's
slice of the weight update, which is how :func:`merge` folds adapters into the
base weights. Initial values are drawn for the full matrices from a generator
seeded by (seed, module name) and then sliced, so any TP size starts from the
same adapter. The adapters live in :class:`LoRAAdapters`, outside the
megatron-core model (the base model's state dict and checkpoint keys are
untouched); forward hooks on the base linears add their outputs.

``modules_to_save`` (PEFT's option of the same name) trains whole base modules
beside the adapters; the one offered is ``final_layernorm``. Why: with tied
embeddings every logit is ``E @ LN(x)``, so a frozen final LayerNorm bounds how
far adapters can move the output distribution; a small model can then not
learn a new answer format at all. Its gain and bias (2 x hidden numbers) train,
are saved in the adapter file under their base names, and are replicated over
tensor-parallel ranks like the norm itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
MODULES_TO_SAVE = {"final_layernorm": "decoder.final_layernorm"}  # option -> megatron-core module path
COLUMN = ("linear_qkv", "linear_fc1")
INITS = ("xavier", "normal", "kaiming", "zero")


@dataclass
class LoRAConfig:
    rank: int = 32
    alpha: float | None = None  # None: = rank (NeMo's default: scale 1)
    dropout: float = 0.0
    targets: tuple[str, ...] = ("linear_qkv",)
    layers: tuple[int, ...] | None = None  # 1-based as NeMo's layer_selection; None: all
    column_init: str = "xavier"
    row_init: str = "zero"
    seed: int = 1234
    modules_to_save: tuple[str, ...] = ()  # whole base modules trained beside the adapters (PEFT's option)

    def __post_init__(self) -> None:
        self.targets = tuple(self.targets)
        self.modules_to_save = tuple(self.modules_to_save)
        unknown = [m for m in self.modules_to_save if m not in MODULES_TO_SAVE]
        if unknown:
            raise ValueError(f"LoRA modules_to_save {unknown}: choose from {', '.join(MODULES_TO_SAVE)}")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise ValueError(f"LoRA targets {list(self.targets)}: choose from {', '.join(TARGETS)}")
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        for name in ("column_init", "row_init"):
            if getattr(self, name) not in INITS:
                raise ValueError(f"LoRA {name} {getattr(self, name)!r}: choose from {', '.join(INITS)}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")

    @property
    def scaling(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["targets"] = list(self.targets)
        d["layers"] = list(self.layers) if self.layers is not None else None
        d["modules_to_save"] = list(self.modules_to_save)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoRAConfig:
        """The inverse of :meth:`as_dict` (adapter_config.json's ``lora`` block; older files lack newer keys)."""
        d = dict(d)
        d["targets"] = tuple(d["targets"])
        d["layers"] = tuple(d["layers"]) if d.get("layers") else None
        d["modules_to_save"] = tuple(d.get("modules_to_save") or ())
        return cls(**d)


def _init(kind: str, shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    t = torch.empty(shape)
    if kind == "zero":
        return t.zero_()
    if kind == "normal":  # NeMo's init_method_normal(0.2)
        return t.normal_(0.0, 0.2, generator=gen)
    if kind == "kaiming":  # NeMo: kaiming_uniform_(a=sqrt(5)) as nn.Linear
        bound = 1.0 / math.sqrt(shape[1])
        return t.uniform_(-bound, bound, generator=gen)
    fan_out, fan_in = shape  # xavier normal, as NeMo's nn.init.xavier_normal_
    std = math.sqrt(2.0 / (fan_in + fan_out))
    return t.normal_(0.0, std, generator=gen)


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1))
    return g


class LoRAModule(nn.Module):
    """One adapter: ``a`` [r, in(/tp)], ``b`` [out(/tp), r]; see the module docstring for the split."""

    def __init__(
        self,
        name: str,
        kind: str,
        in_full: int,
        out_full: int,
        cfg: LoRAConfig,
        tp: int,
        tp_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        glu: bool = False,
    ):
        super().__init__()
        self.name, self.kind, self.tp, self.tp_rank = name, kind, tp, tp_rank
        self.scaling = cfg.scaling
        self.parallel = "column" if kind in COLUMN else "row"
        gen = _generator(cfg.seed, name)
        a = _init(cfg.column_init, (cfg.rank, in_full), gen)
        b = _init(cfg.row_init, (out_full, cfg.rank), gen)
        # linear_fc1 of a gated MLP (SwiGLU) holds [gate; up]: each rank has its slice of both halves
        self.glu = kind == "linear_fc1" and glu
        if self.parallel == "column" and self.glu:
            gate, up = b.chunk(2, dim=0)
            b = torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
        elif self.parallel == "column":
            b = b.chunk(tp, dim=0)[tp_rank]
        else:
            a = a.chunk(tp, dim=1)[tp_rank]
        self.a = nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
        self.b = nn.Parameter(b.to(device=device, dtype=dtype).contiguous())
        # megatron-core's attributes: the optimizer counts replicated parameters once in the grad norm
        for p, split, dim in ((self.a, self.parallel == "row", 1), (self.b, self.parallel == "column", 0)):
            p.tensor_model_parallel = split and tp > 1  # type: ignore[attr-defined]
            p.partition_dim = dim  # type: ignore[attr-defined]
            p.partition_stride = 1  # type: ignore[attr-defined]
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.enabled = True  # False: the hook leaves the base linear's output alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.linear(self.dropout(x), self.a)
        if self.tp > 1:
            from megatron.core.tensor_parallel import mappings

            h = (
                mappings.copy_to_tensor_model_parallel_region(h)
                if self.parallel == "column"
                else mappings.reduce_from_tensor_model_parallel_region(h)
            )
        return torch.nn.functional.linear(h, self.b) * self.scaling

    def delta(self) -> torch.Tensor:
        """This rank's slice of the weight update ``scaling * B @ A`` (fp32)."""
        return (self.b.float() @ self.a.float()) * self.scaling


def target_linears(model, cfg: LoRAConfig) -> list[tuple[str, str, nn.Module]]:
    """(name, kind, linear) for every selected linear of the megatron-core GPTModel."""
    out = []
    layers = model.decoder.layers
    chosen = set(cfg.layers) if cfg.layers is not None else set(range(1, len(layers) + 1))
    bad = sorted(i for i in chosen if not 1 <= i <= len(layers))
    if bad:
        raise ValueError(f"LoRA layer selection {bad}: the model has layers 1..{len(layers)}")
    for i, layer in enumerate(layers, 1):
        if i not in chosen:
            continue
        for kind in cfg.targets:
            parent = layer.self_attention if kind in ("linear_qkv", "linear_proj") else layer.mlp
            if not hasattr(parent, kind):
                raise ValueError(
                    f"LoRA on {kind}: layer {i}'s MLP is a mixture of experts (a router and "
                    f"{getattr(getattr(parent, 'experts', None), 'num_local_experts', '?')} experts), which adapters "
                    "do not cover yet; target the attention: linear_qkv, linear_proj"
                )
            lin = getattr(parent, kind)
            if type(lin).__name__.startswith("TELayerNorm"):
                raise ValueError(
                    f"LoRA on {kind}: Transformer Engine's fused LayerNorm+linear hides the normalised input; "
                    "build the model with the local spec (no transformer_engine)"
                )
            sub = "self_attention" if kind in ("linear_qkv", "linear_proj") else "mlp"
            out.append((f"decoder.layers.{i - 1}.{sub}.{kind}", kind, lin))
    return out


class LoRAAdapters(nn.Module):
    """All adapters of a model, keyed by the base linear's name (dots as '/': ModuleDict keys)."""

    def __init__(self, model, cfg: LoRAConfig):
        super().__init__()
        from megatron.core import parallel_state

        self.cfg = cfg
        tp = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.adapters = nn.ModuleDict()
        self._hooks = []
        for name, kind, lin in target_linears(model, cfg):
            w: torch.Tensor = lin.weight  # type: ignore[assignment]
            out_local, in_local = w.shape
            in_full = in_local * tp if kind not in COLUMN else in_local
            out_full = out_local * tp if kind in COLUMN else out_local
            mod = LoRAModule(
                name,
                kind,
                in_full,
                out_full,
                cfg,
                tp,
                tp_rank,
                w.dtype,
                w.device,
                glu=bool(model.config.gated_linear_unit),
            )
            self.adapters[name.replace(".", "/")] = mod
            self._hooks.append(lin.register_forward_hook(_hook(mod)))
        # base modules trained as a whole; plain references (not submodules: they stay the base model's)
        self.saved: dict[str, nn.Module] = {
            MODULES_TO_SAVE[m]: model.get_submodule(MODULES_TO_SAVE[m]) for m in cfg.modules_to_save
        }

    def saved_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        """(base name, parameter) of every module in ``modules_to_save``, e.g. ``decoder.final_layernorm.weight``."""
        for path, module in self.saved.items():
            for pname, p in module.named_parameters():
                yield f"{path}.{pname}", p

    def unfreeze_saved(self) -> None:
        for _, p in self.saved_parameters():
            p.requires_grad_(True)

    def named_adapters(self) -> Iterable[tuple[str, LoRAModule]]:
        for k, m in self.adapters.items():
            yield k.replace("/", "."), m  # type: ignore[misc]

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model alone inside (DPO's adapter-off reference): every adapter's hook passes through."""
        mods = [m for _, m in self.named_adapters()]
        for m in mods:
            m.enabled = False
        try:
            yield
        finally:
            for m in mods:
                m.enabled = True

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def sharded_state_dict(self, prefix: str = "lora.") -> dict:
        """dist_checkpointing ShardedTensors with the right TP axis (B of column, A of row layers are split)."""
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        dp_rank = parallel_state.get_data_parallel_rank()
        out = {}
        for name, m in self.named_adapters():
            for pname, p, split_dim in (
                ("a", m.a, 1 if m.parallel == "row" else None),
                ("b", m.b, 0 if m.parallel == "column" else None),
            ):
                key = f"{prefix}{name}.{pname}"
                if split_dim is None or m.tp == 1:
                    out[key] = ShardedTensor.from_rank_offsets(key, p, replica_id=(0, m.tp_rank, dp_rank))
                else:
                    out[key] = ShardedTensor.from_rank_offsets(
                        key, p, (split_dim, m.tp_rank, m.tp), replica_id=(0, 0, dp_rank)
                    )
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        for name, p in self.saved_parameters():  # norms: the same on every tensor-parallel rank
            key = f"{prefix}{name}"
            out[key] = ShardedTensor.from_rank_offsets(key, p, replica_id=(0, tp_rank, dp_rank))
        return out

    def load_sharded(self, loaded: dict, prefix: str = "lora.") -> None:
        """Copy a checkpoint's tensors (keys of :meth:`sharded_state_dict`) into the adapters and saved modules."""
        with torch.no_grad():
            for name, m in self.named_adapters():
                m.a.copy_(loaded[f"{prefix}{name}.a"])
                m.b.copy_(loaded[f"{prefix}{name}.b"])
            for name, p in self.saved_parameters():
                p.copy_(loaded[f"{prefix}{name}"])


def _hook(mod: LoRAModule):
    def hook(module, args, output):
        if not mod.enabled:
            return output
        x = args[0]
        out, bias = output
        return out + mod(x).to(out.dtype), bias

    return hook


def full_tensors(adapters: LoRAAdapters) -> dict[str, torch.Tensor]:
    """Every adapter matrix gathered over tensor-parallel ranks, fp32 on the CPU: ``{name}.lora_a/.lora_b``."""
    out = {}
    for name, m in adapters.named_adapters():
        a, b = m.a.detach(), m.b.detach()
        if m.tp > 1:
            from megatron.core import parallel_state

            group = parallel_state.get_tensor_model_parallel_group()
            t, dim = (b, 0) if m.parallel == "column" else (a, 1)
            parts = [torch.empty_like(t) for _ in range(m.tp)]
            torch.distributed.all_gather(parts, t.contiguous(), group=group)
            if m.parallel == "column":
                b = torch.cat(parts, dim=dim)
            else:
                a = torch.cat(parts, dim=dim)
        if m.glu and m.tp > 1:  # [gate_r; up_r] per rank -> [gate; up] for the whole layer
            halves = [p.chunk(2, dim=0) for p in b.chunk(m.tp, dim=0)]
            b = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        out[f"{name}.lora_a"] = a.float().cpu().contiguous()
        out[f"{name}.lora_b"] = b.float().cpu().contiguous()
    for name, p in adapters.saved_parameters():
        out[name] = p.detach().float().cpu().contiguous()
    return out


def load_full_tensors(adapters: LoRAAdapters, tensors: dict[str, torch.Tensor]) -> None:
    """Load gathered adapter matrices (from :func:`full_tensors` / adapter.safetensors) into this rank's slices."""
    with torch.no_grad():
        for name, m in adapters.named_adapters():
            a, b = tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"]
            if m.parallel == "column":
                if m.glu:
                    gate, up = b.chunk(2, dim=0)
                    b = torch.cat([gate.chunk(m.tp, dim=0)[m.tp_rank], up.chunk(m.tp, dim=0)[m.tp_rank]], dim=0)
                else:
                    b = b.chunk(m.tp, dim=0)[m.tp_rank]
            else:
                a = a.chunk(m.tp, dim=1)[m.tp_rank]
            if a.shape != m.a.shape or b.shape != m.b.shape:
                raise ValueError(
                    f"adapter {name}: shapes {tuple(a.shape)}/{tuple(b.shape)} do not fit "
                    f"{tuple(m.a.shape)}/{tuple(m.b.shape)}"
                )
            m.a.copy_(a)
            m.b.copy_(b)
        for name, p in adapters.saved_parameters():
            if name not in tensors:
                raise ValueError(f"adapter file has no {name} (modules_to_save)")
            p.copy_(tensors[name])


def merge(model, adapters: LoRAAdapters) -> None:
    """Fold every adapter into its base weight (in place) and remove the hooks: the model alone then
    computes what base + adapters computed (saved modules already are the model's own)."""
    with torch.no_grad():
        for name, m in adapters.named_adapters():
            lin = model.get_submodule(name)
            lin.weight.add_(m.delta().to(lin.weight.dtype))
    adapters.remove()
