"""What a model family provides, and the machinery that applies its tables (torch-free to import).

A family (``gpt2``, ``llama``, one module each next to this file) is a :class:`Family`:

* ``defaults`` and ``presets``: the architecture keys of :class:`snakellm.models.ModelSettings`
  that the family fixes when a config does not name them, and its named shapes;
* ``features``: the architecture keys its Hugging Face class cannot change (position
  embedding, norm, activation). An architecture with other values has no faithful
  export to this class;
* ``hf_keys``: the ``config.json`` <-> architecture table. Export and import both read it,
  so a key is written and read back by the same row;
* ``weights``: the weight-name table, one :class:`Weight` row per megatron-core tensor.
  :meth:`Family.to_hf`, :meth:`Family.from_hf` and the PEFT adapter names all derive from
  it: the import map is the export map read backwards (``tests/test_families.py`` checks
  that on every registered family);
* optional hooks with neutral defaults, for what the next families need and these two do
  not: extra architecture keys, extra ``TransformerConfig`` / ``GPTModel`` arguments (qkv
  bias, sliding window, rope scaling), RoPE frequencies for the KV-cached decoder, extra
  NeMo ``model_config.yaml`` keys or a reason NeMo 1.x cannot represent the model.

Tensor work imports torch inside the functions: importing a family (the Snakefile and the
config checks do) must stay cheap and torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from snakellm.errors import UsageError

Arch = dict[str, Any]


class FamilyError(UsageError, ValueError):
    """A model or file that no registered family represents exactly, phrased with the key and value."""


# ----------------------------------------------------------------------------- conditions on an architecture


def biased(arch: Arch) -> bool:
    """The linear layers carry biases."""
    return bool(arch["bias"])


def untied(arch: Arch) -> bool:
    """The output layer has its own weight (not the input embedding's)."""
    return not arch["tie_embeddings"]


# ----------------------------------------------------------------------------- row layouts


@dataclass(frozen=True)
class Sizes:
    """What a row layout needs beyond the tensor: the architecture and the two vocabulary sizes."""

    arch: Arch
    vocab: int  # the tokenizer's (HF files hold this many rows)
    padded_vocab: int  # megatron-core's (a multiple of make_vocab_size_divisible_by)


def head_dim(arch: Arch) -> int:
    """The size of one attention head: the family's ``kv_channels`` (Qwen3's 128 at d=1024 and 16 heads),
    else ``hidden_size / num_attention_heads`` as in every earlier family."""
    return int(arch.get("kv_channels") or arch["hidden_size"] // arch["num_attention_heads"])


def _heads(s: Sizes) -> tuple[int, int, int]:
    """(query heads, query groups, head dim)."""
    n, g = s.arch["num_attention_heads"], s.arch["num_query_groups"]
    return n, g, head_dim(s.arch)


def qkv_split(t: Any, s: Sizes) -> tuple[Any, Any, Any]:
    """megatron-core's fused qkv rows, grouped per query group ``[q (heads/group x d), k (d), v (d)]`` -> q, k, v."""
    n, g, d = _heads(s)
    per = n // g
    x = t.reshape(g, per + 2, d, *t.shape[1:])
    rest = t.shape[1:]
    return x[:, :per].reshape(n * d, *rest), x[:, per].reshape(g * d, *rest), x[:, per + 1].reshape(g * d, *rest)


def qkv_merge(parts: tuple[Any, ...], s: Sizes) -> Any:
    """q, k, v -> megatron-core's per-group interleaved rows (the inverse of :func:`qkv_split`)."""
    import torch

    q, k, v = parts
    n, g, d = _heads(s)
    per = n // g
    rest = q.shape[1:]
    x = torch.cat([q.reshape(g, per, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)], dim=1)
    return x.reshape(g * (per + 2) * d, *rest)


def _cat(parts: tuple[Any, ...]) -> Any:
    import torch

    return torch.cat(list(parts))


def _qkv_cat_split(t: Any, s: Sizes) -> tuple[Any]:
    return (_cat(qkv_split(t, s)),)


def _qkv_cat_merge(parts: tuple[Any, ...], s: Sizes) -> Any:
    n, g, d = _heads(s)
    t = parts[0]
    return qkv_merge((t[: n * d], t[n * d : (n + g) * d], t[(n + g) * d :]), s)


def _gate_up_split(t: Any, s: Sizes) -> tuple[Any, Any]:
    f = t.shape[0] // 2  # the MLP's width, or an expert's (moe_ffn_hidden_size)
    return t[:f], t[f:]


def _vocab_trim(t: Any, s: Sizes) -> tuple[Any]:
    return (t[: s.vocab],)


def _vocab_pad(parts: tuple[Any, ...], s: Sizes) -> Any:
    import torch

    t = parts[0]
    if t.shape[0] > s.padded_vocab:
        raise FamilyError(f"vocabulary {t.shape[0]} is larger than the padded size {s.padded_vocab}")
    return torch.cat([t, t.new_zeros(s.padded_vocab - t.shape[0], *t.shape[1:])])


@dataclass(frozen=True)
class Rows:
    """How megatron-core's output rows of one tensor become the Hugging Face tensor(s), and back.

    ``split`` and ``merge`` are inverses; LoRA's ``B`` matrices (one row per output) are
    split the same way as the weight they adapt.
    """

    split: Callable[[Any, Sizes], tuple[Any, ...]]
    merge: Callable[[tuple[Any, ...], Sizes], Any]


ROWS: dict[str, Rows] = {
    "same": Rows(lambda t, s: (t,), lambda p, s: p[0]),
    # the embedding and an untied output layer: HF holds the tokenizer's rows, megatron-core the padded ones
    "vocab": Rows(_vocab_trim, _vocab_pad),
    # fused qkv -> separate q, k, v (Llama's q_proj, k_proj, v_proj)
    "qkv": Rows(qkv_split, qkv_merge),
    # fused qkv -> [q; k; v] over all heads (GPT-2's c_attn)
    "qkv_cat": Rows(_qkv_cat_split, _qkv_cat_merge),
    # SwiGLU's fused fc1 = [gate; up] -> gate_proj, up_proj
    "gate_up": Rows(_gate_up_split, lambda p, s: _cat(p)),
}


# ----------------------------------------------------------------------------- the two tables


@dataclass(frozen=True)
class Weight:
    """One megatron-core tensor and the Hugging Face tensor(s) it is; ``{i}`` stands for the layer index.

    ``conv1d``: the HF module stores ``[in, out]`` (GPT-2's ``Conv1D``), so 2-D tensors are
    transposed (and PEFT's ``fan_in_fan_out`` is true). ``when``: the tensor exists only for
    architectures where this is true (biases, an untied output layer). ``hf_always``: the HF
    class has the tensor whatever ``when`` says; export writes zeros (which compute the same).
    ``import_fallback``: the HF tensor to read when ``theirs`` is absent (an untied model whose
    file has no ``lm_head.weight`` reads the embedding, as transformers does).
    """

    ours: str
    theirs: tuple[str, ...]
    rows: str = "same"
    conv1d: bool = False
    when: Callable[[Arch], bool] | None = None
    hf_always: bool = False
    import_fallback: str | None = None

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.ours

    @property
    def module(self) -> str:
        """The megatron-core module path (``decoder.layers.{i}.self_attention.linear_qkv``)."""
        return self.ours.rsplit(".", 1)[0]


_REQUIRED = object()


@dataclass(frozen=True)
class HFKey:
    """One ``config.json`` key and the architecture key it carries (both directions).

    ``default``: what import assumes when the key is absent or null (not given: the key is
    required; None: the family's default, or what ``resolve`` derives, applies);
    ``to_hf`` / ``from_hf`` convert the value (e.g. float RoPE theta). ``export_only``: written
    for transformers' benefit but derived from another key (``n_ctx``, ``mlp_bias``).
    """

    hf: str
    ours: str
    default: Any = _REQUIRED
    to_hf: Callable[[Any], Any] = lambda v: v
    from_hf: Callable[[Any], Any] = lambda v: v
    export_only: bool = False


# ----------------------------------------------------------------------------- the family


def _no_extras(arch: Arch) -> dict[str, Any]:
    return {}


def _no_reason(arch: Arch) -> str | None:
    return None


def _no_import_checks(config: dict[str, Any], where: str) -> dict[str, Any]:
    return {}


def default_rope_inv_freq(arch: Arch, dim: int, device: Any = None) -> Any:
    """Plain RoPE, ``1 / base^(2j/d)`` for ``j < d/2``, computed as megatron-core's ``RotaryEmbedding`` does
    (float32, the same ops), so the KV-cached decoder rotates bit for bit like the model's forward."""
    import torch

    return 1.0 / (arch["rotary_base"] ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


@dataclass(frozen=True)
class Family:
    """Everything snakellm knows about one model family; see the module docstring and docs/extending.md."""

    name: str  # the model style: runs.<run>.model.style
    summary: str  # one phrase for --help (ModelSettings.style's help)
    defaults: Mapping[str, Any]
    presets: Mapping[str, Mapping[str, Any]]
    features: Mapping[str, Any]
    hf_model_type: str
    hf_architecture: str
    hf_keys: tuple[HFKey, ...]
    weights: tuple[Weight, ...]
    # --- optional hooks (neutral defaults) ---
    # architecture keys only this family has, with their defaults (kept in the resolved dict)
    arch_keys: Mapping[str, Any] = field(default_factory=dict)
    # why the HF class cannot compute an architecture that has the family's features (None: it can)
    hf_refuses: Callable[[Arch], str | None] = _no_reason
    # config.json keys beyond the hf_keys table (constants, derived values)
    hf_export_extra: Callable[[Arch], dict[str, Any]] = _no_extras
    # checks of an HF config (raise FamilyError naming key and value) + architecture keys not in hf_keys
    hf_import_extra: Callable[[dict[str, Any], str], dict[str, Any]] = _no_import_checks
    # extra megatron-core TransformerConfig / GPTModel arguments (qkv bias, window, rope scaling)
    megatron_config: Callable[[Arch], dict[str, Any]] = _no_extras
    megatron_model: Callable[[Arch], dict[str, Any]] = _no_extras
    # RoPE inverse frequencies the KV-cached decoder uses (rope scaling changes them)
    rope_inv_freq: Callable[[Arch, int, Any], Any] = default_rope_inv_freq
    # NeMo model_config.yaml: keys beyond the shared table, and why NeMo 1.x cannot hold the model
    nemo_extra: Callable[[Arch], dict[str, Any]] = _no_extras
    nemo_refuses: Callable[[Arch], str | None] = _no_reason
    # architecture keys read from a NeMo model_config.yaml beyond the shared table (and its checks)
    nemo_import_extra: Callable[[dict[str, Any], str], dict[str, Any]] = _no_import_checks
    # two families sharing one HF model_type (Llama 2 and Llama 3.x): the later one claims the configs
    # that are its own (e.g. rope_scaling of type llama3); None claims every config of its model_type
    hf_claims: Callable[[dict[str, Any]], bool] | None = None
    # a NeMo model_config.yaml this family reads (qkv_bias without bias, rope scaling, a window): it is
    # labelled with this family rather than the first one with its features
    nemo_claims: Callable[[dict[str, Any]], bool] | None = None

    # ---------------------------------------------------------------- architecture

    def computes(self, arch: Arch) -> str | None:
        """None when this family's HF class computes ``arch`` exactly, else the reason it does not."""
        off = {k: arch.get(k) for k, v in self.features.items() if arch.get(k) != v}
        if off:
            return ", ".join(f"{k}={v}" for k, v in off.items())
        if bool(arch.get("num_experts")) != bool(self.defaults.get("num_experts")):
            kind = "a mixture of experts" if self.defaults.get("num_experts") else "dense"
            return f"num_experts={arch.get('num_experts')}: {self.hf_architecture} is {kind}"
        return self.hf_refuses(arch)

    def needs(self) -> str:
        """The features in words: ``GPT2LMHeadModel needs learned positions, LayerNorm, gelu``."""
        return f"{self.hf_architecture} needs " + ", ".join(str(v) for v in self.features.values())

    # ---------------------------------------------------------------- config.json

    def hf_config(self, arch: Arch) -> dict[str, Any]:
        """The family's part of config.json (model_type, architectures, the key table, extras)."""
        out: dict[str, Any] = {"architectures": [self.hf_architecture], "model_type": self.hf_model_type}
        for key in self.hf_keys:
            out[key.hf] = key.to_hf(arch[key.ours])
        out.update(self.hf_export_extra(arch))
        return out

    def arch_from_hf(self, config: dict[str, Any], where: str) -> dict[str, Any]:
        """Architecture overrides (for ``resolve(None, ...)``) from an HF config of this family."""
        over: dict[str, Any] = {"style": self.name}
        over.update(self.hf_import_extra(config, where))
        for key in self.hf_keys:
            if key.export_only:
                continue
            if config.get(key.hf) is None:
                if key.default is _REQUIRED:
                    raise FamilyError(f"{where}: {key.hf} is missing ({self.hf_model_type} config)")
                if key.default is not None:
                    over[key.ours] = key.default
                continue
            over[key.ours] = key.from_hf(config[key.hf])
        return over

    # ---------------------------------------------------------------- weights

    def _rows(self, arch: Arch, group: int | None = None) -> list[tuple[Weight, str, tuple[str, ...]]]:
        """Every (row, our name, HF names) of this architecture, layers expanded, in table order.

        ``{i}`` is the layer, ``{e}`` an expert (a row per expert of each layer, experts in order).
        ``group``: only layer ``group``'s rows, or (-1) only those outside the layers (streaming
        conversions convert one group at a time: a mixture-of-experts layer with all its experts).
        """
        layer = [w for w in self.weights if w.per_layer]
        first = self.weights.index(layer[0]) if layer else len(self.weights)
        head = [w for w in self.weights[:first] if not w.per_layer]
        tail = [w for w in self.weights[first:] if not w.per_layer]
        outer = [(w, w.ours, w.theirs) for w in head + tail]
        if group is not None and group < 0:
            return outer
        experts = range(arch.get("num_experts") or 0)

        def rows_of(i: int) -> list[tuple[Weight, str, tuple[str, ...]]]:
            out = []
            for w in layer:
                for e in experts if "{e}" in w.ours else (None,):
                    out.append((w, w.ours.format(i=i, e=e), tuple(t.format(i=i, e=e) for t in w.theirs)))
            return out

        if group is not None:
            return rows_of(group)
        out = [(w, w.ours, w.theirs) for w in head]
        for i in range(arch["num_layers"]):  # layer by layer, as the files of transformers are ordered
            out += rows_of(i)
        return out + [(w, w.ours, w.theirs) for w in tail]

    def to_hf(self, arch: Arch, tensors: Any, vocab: int, group: int | None = None) -> dict[str, Any]:
        """HF state dict (independent contiguous tensors) from megatron-core tensors (local-spec names).

        ``tensors``: a mapping (a dict, or a reader); ``group``: one layer, or -1 (see :meth:`_rows`).
        """
        s = Sizes(arch, vocab, 0)
        out: dict[str, Any] = {}
        for w, ours, theirs in self._rows(arch, group):
            if w.when is None or w.when(arch):
                t = tensors[ours]
            elif w.hf_always:  # a bias the HF class always has: the weight's output rows, zero
                ref = tensors[ours.rsplit(".", 1)[0] + ".weight"]
                t = ref.new_zeros(ref.shape[0])
            else:
                continue
            for name, part in zip(theirs, ROWS[w.rows].split(t, s), strict=True):
                if w.conv1d and part.dim() == 2:
                    part = part.t()
                out[name] = part.detach().contiguous().clone()
        return out

    def from_hf(self, arch: Arch, hf: Any, padded_vocab: int, group: int | None = None) -> dict[str, Any]:
        """megatron-core tensors (local-spec names) from an HF state dict; the vocabulary zero-padded.

        ``hf``: a mapping (a dict, or a reader of safetensors files); ``group``: see :meth:`_rows`.
        """
        s = Sizes(arch, 0, padded_vocab)

        def get(name: str, fallback: str | None) -> Any:
            if name not in hf and fallback is not None:
                name = fallback
            if name not in hf:
                raise FamilyError(f"tensor {name} missing from the Hugging Face checkpoint")
            return hf[name]

        out: dict[str, Any] = {}
        for w, ours, theirs in self._rows(arch, group):
            if w.when is not None and not w.when(arch):
                continue
            parts = tuple(get(name, w.import_fallback) for name in theirs)
            if w.conv1d:
                parts = tuple(p.t() if p.dim() == 2 else p for p in parts)
            out[ours] = ROWS[w.rows].merge(parts, s)
        return out

    # ---------------------------------------------------------------- PEFT

    @property
    def fan_in_fan_out(self) -> bool:
        """PEFT's flag: the HF linears store ``[in, out]`` (GPT-2's Conv1D)."""
        return any(w.conv1d for w in self.weights if w.ours.endswith(".weight") and w.per_layer)

    def peft_modules(self, module: str) -> tuple[tuple[str, ...], str]:
        """(HF modules, row layout) that LoRA on megatron-core ``module`` (a layer's linear) becomes."""
        found = self._rows_for_module(module)
        if not found:
            raise FamilyError(f"{self.name}: no Hugging Face module for {module!r}")
        w, _, theirs = found[0]
        return tuple(t.rsplit(".", 1)[0] for t in theirs), w.rows

    def hf_module(self, module: str) -> str:
        """The HF module a megatron-core module (saved whole: PEFT's modules_to_save) is, e.g. ``model.norm``."""
        mods, rows = self.peft_modules(module)
        if len(mods) != 1 or rows != "same":
            raise FamilyError(f"{self.name}: {module!r} is not one Hugging Face module")
        return mods[0]

    def _rows_for_module(self, module: str) -> list[tuple[Weight, str, tuple[str, ...]]]:
        out = []
        for w in self.weights:
            if not w.ours.endswith(".weight"):
                continue
            pattern = w.module
            if w.per_layer:
                head, tail = pattern.split("{i}")
                if module.startswith(head) and module.endswith(tail):
                    i = module[len(head) : len(module) - len(tail)]
                    if i.isdigit():
                        out.append((w, w.ours.format(i=i), tuple(t.format(i=i) for t in w.theirs)))
            elif pattern == module:
                out.append((w, w.ours, w.theirs))
        return out
