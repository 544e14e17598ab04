"""KV-cached text generation from a checkpoint, and ``snakellm generate``.

:class:`Decoder` runs the transformer of a loaded megatron-core ``GPTModel`` with
its own key/value cache. It reads the model's parameters in place (no copy) and
computes what megatron-core's forward computes, op for op: LayerNorm/RMSNorm,
the grouped ``[q, k, v]`` projection, RoPE with megatron's (non-interleaved)
rotation or learned positions, ``scaled_dot_product_attention`` with
grouped-query heads, GeLU or SwiGLU, the (tied) output layer. The tests check
that cached greedy decoding gives the same tokens as re-running megatron-core's
full forward at every step. Why not megatron-core's own inference context:
snakellm's core attention is SDPA with ``is_causal`` (correct for a full
sequence only), and a plain loop over a few fused ops is also what keeps
batch-1 decoding from being launch-bound.

Batches of prompts of different lengths are left-padded: every row writes its
keys at the same cache slot each step, positions are counted per row from its
first real token, and padding is masked out of attention.

Sampling (per step, on fp32 logits of the real vocabulary, in vLLM's order):
``logit_bias`` added, repetition penalty (HF/CTRL style: divide positive logits
of tokens already in the row, prompt included, multiply negative ones),
frequency and presence penalties (OpenAI's: subtract ``frequency_penalty``
times the count of each token generated so far, and ``presence_penalty`` once
for each token generated at least once), EOD forbidden until ``min_new_tokens``, then
greedy argmax, or temperature -> top-k -> top-p (nucleus, at least one token
kept) -> a draw from a ``torch.Generator`` seeded with ``seed``. A row stops at
EOD, at any of ``end_strings`` appearing in its generated text, or after
``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snakellm.errors import UsageError
from snakellm.models import families


class GenerationError(UsageError, ValueError):
    """A request that cannot be served, phrased with the offending field."""

    def __init__(self, msg: str, field: str | None = None) -> None:
        super().__init__(msg)
        self.field = field


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    min_new_tokens: int = 0
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from the logit of each token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the generated tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the logits of these token ids
    end_strings: Sequence[str] = ()
    stop_at_eod: bool = True
    seed: int | None = None
    logprobs: bool = False
    all_probs: bool = False

    def check(self) -> None:
        def bad(f: str, why: str):
            raise GenerationError(f"{f} {why}", f)

        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 0:
            bad("max_new_tokens", f"must be an integer >= 0, got {self.max_new_tokens!r}")
        if not isinstance(self.min_new_tokens, int) or isinstance(self.min_new_tokens, bool) or self.min_new_tokens < 0:
            bad("min_new_tokens", f"must be an integer >= 0, got {self.min_new_tokens!r}")
        if not self.greedy and not (0 < self.temperature <= 100):
            bad("temperature", f"must be in (0, 100], got {self.temperature!r}")
        if self.top_k < 0:
            bad("top_k", f"must be >= 0, got {self.top_k!r}")
        if not 0 <= self.top_p <= 1:
            bad("top_p", f"must be in [0, 1], got {self.top_p!r}")
        if self.repetition_penalty < 1.0:
            bad("repetition_penalty", f"must be >= 1.0, got {self.repetition_penalty!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("random_seed", f"must be an integer >= 0, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                bad(name, f"must be a number in [-2, 2], got {v!r}")
        for t, b in self.logit_bias.items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                bad("logit_bias", f"keys must be token ids (integers >= 0), got {t!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100.0 <= b <= 100.0:
                bad("logit_bias", f"values must be numbers in [-100, 100], got {b!r} for token {t}")

    def check_vocab(self, vocab: int) -> None:
        """Every ``logit_bias`` token id inside the vocabulary (a GenerationError naming the field if not)."""
        out = sorted(t for t in self.logit_bias if not 0 <= t < vocab)
        if out:
            raise GenerationError(
                f"logit_bias: token id {out[0]} is outside the vocabulary (0..{vocab - 1})", "logit_bias"
            )

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the per-token pass: a repetition, presence or frequency penalty, or a bias."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or any(b != 0 for b in self.logit_bias.values())
        )


@dataclass
class Completion:
    prompt_ids: list[int]
    ids: list[int]  # generated token ids (the final EOD / end-string tokens included)
    text: str  # decoded generated ids
    finish_reason: str  # "length" | "eod" | "end_string"
    logprobs: list[float] = field(default_factory=list)  # log p of each generated token (when asked)
    prompt_logprobs: list[float] = field(default_factory=list)  # log p of prompt tokens 1.. (when asked)
    full_logprobs: list[list[float]] | None = None  # [positions][vocab] (all_probs)


# ----------------------------------------------------------------------------- tokenizers


def load_tokenizer(block: dict[str, Any], base: Path | None = None):
    """Our tokenizer (snakellm.tokenize.encoders) from a blend.json / run_config tokenizer block."""
    from snakellm.tokenize import encoders

    files = {}
    for k, v in (block.get("files") or {}).items():
        p = Path(v)
        if not p.is_absolute() and not p.exists() and base is not None:
            p = base / p
        files[k] = str(p)
    if not files:
        raise GenerationError("the checkpoint records no tokenizer files; pass the blend.json (--blend)")
    return encoders.load(
        block["kind"],
        name=block.get("name", ""),
        eod=block.get("eod_token"),
        vocab_file=files.get("vocab_file"),
        merges_file=files.get("merges_file"),
        model_file=files.get("model_file"),
        tokenizer_file=files.get("tokenizer_file"),
    )


def token_strings(tok, ids: Sequence[int]) -> list[str]:
    """Each id's piece as the tokenizer spells it (``▁the``, ``Ġthe``), as NeMo's ``ids_to_tokens``."""
    if tok.kind == "sentencepiece":
        return [tok._sp.id_to_piece(int(i)) for i in ids]
    if tok.kind == "huggingface":
        return [tok._tok.id_to_token(int(i)) or "" for i in ids]
    from snakellm.tokenize.encoders import bytes_to_unicode

    b2u = bytes_to_unicode()
    if tok.backend == "tiktoken":
        return ["".join(b2u[b] for b in tok._enc.decode_single_token_bytes(int(i))) for i in ids]
    return [tok._hf.id_to_token(int(i)) or "" for i in ids]


def bos_id(tok) -> int:
    if tok.kind == "sentencepiece" and tok._sp.bos_id() >= 0:
        return int(tok._sp.bos_id())
    return int(tok.eod_id)  # GPT-2: <|endoftext|> is also BOS (NeMo's GPT2 tokenizer does the same)


# ----------------------------------------------------------------------------- the decoder


class Decoder:
    """KV-cached forward over a megatron-core GPTModel's own parameters."""

    def __init__(self, model, arch: dict[str, Any], vocab_size: int, virtual=None) -> None:

        from snakellm.export.hf import megatron_tensors

        self.arch = arch
        self.vocab_size = vocab_size
        w = megatron_tensors(model)
        self.emb = w["embedding.word_embeddings.weight"]
        self.pos_emb = w.get("embedding.position_embeddings.weight")
        self.out = w.get("output_layer.weight", self.emb)
        self.device = self.emb.device
        self.dtype = self.emb.dtype
        # p-tuning's virtual-token embeddings [N, h], cast once: they replace the embeddings of each
        # row's first N tokens, which are prompt tokens, so only a forward from slot 0 (prefill) meets them
        self.virtual = None if virtual is None else virtual.to(device=self.device, dtype=self.dtype)
        self.layers: list[dict[str, Any]] = []
        for i in range(arch["num_layers"]):
            p = f"decoder.layers.{i}."
            self.layers.append(
                {
                    k: w.get(p + n)
                    for k, n in (
                        ("ln1_w", "input_layernorm.weight"),
                        ("ln1_b", "input_layernorm.bias"),
                        ("qkv_w", "self_attention.linear_qkv.weight"),
                        ("qkv_b", "self_attention.linear_qkv.bias"),
                        ("proj_w", "self_attention.linear_proj.weight"),
                        ("proj_b", "self_attention.linear_proj.bias"),
                        ("ln2_w", "pre_mlp_layernorm.weight"),
                        ("ln2_b", "pre_mlp_layernorm.bias"),
                        ("fc1_w", "mlp.linear_fc1.weight"),
                        ("fc1_b", "mlp.linear_fc1.bias"),
                        ("fc2_w", "mlp.linear_fc2.weight"),
                        ("fc2_b", "mlp.linear_fc2.bias"),
                        ("qn_w", "self_attention.q_layernorm.weight"),  # QK-norm (Qwen3): None without
                        ("qn_b", "self_attention.q_layernorm.bias"),
                        ("kn_w", "self_attention.k_layernorm.weight"),
                        ("kn_b", "self_attention.k_layernorm.bias"),
                    )
                }
            )
        self.moe = bool(arch.get("num_experts"))
        if self.moe:
            for i, L in enumerate(self.layers):
                L.update(_expert_stacks(model, i, arch["num_experts"]))
        self.final_w = w["decoder.final_layernorm.weight"]
        self.final_b = w.get("decoder.final_layernorm.bias")
        self.n = arch["num_attention_heads"]
        self.g = arch["num_query_groups"]
        self.d = families.head_dim(arch)
        self.eps = arch["layernorm_epsilon"]
        self.rope = arch["position_embedding"] == "rope"
        if self.rope:  # the family's frequencies (rope scaling changes them), as megatron-core computes them
            self.inv_freq = families.get(arch["style"]).rope_inv_freq(arch, self.d, self.device)
        self.max_len = arch["seq_length"]

    def cast(self, dtype) -> Decoder:
        """This decoder over its weights in ``dtype`` (a copy, each tensor cast once: tied ones stay shared),
        e.g. the fp32 reference of a bf16 model: the same values, computed without bf16's rounding."""
        import copy

        out = copy.copy(self)
        done: dict[int, Any] = {}

        def c(t):
            if t is None:
                return None
            if id(t) not in done:
                done[id(t)] = t.to(dtype)
            return done[id(t)]

        out.emb, out.pos_emb, out.out, out.virtual = c(self.emb), c(self.pos_emb), c(self.out), c(self.virtual)
        out.final_w, out.final_b = c(self.final_w), c(self.final_b)
        out.layers = [{k: c(v) for k, v in L.items()} for L in self.layers]
        out.dtype = dtype
        return out

    def route(self, x, router_w):
        """megatron-core's TopKRouter on tokens ``x`` [n, h]: (probabilities [n, k], expert ids [n, k]), fp32 scores."""
        import torch.nn.functional as F

        a, k = self.arch, self.arch["moe_router_topk"]
        logits = F.linear(x.float(), router_w.float())
        if a["moe_score_function"] == "sigmoid":
            probs, idx = logits.sigmoid().topk(k, dim=-1)
            if k > 1:
                probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        elif a["moe_norm_topk_prob"]:  # softmax over the top-k logits = the top k of the softmax, renormalised
            top, idx = logits.topk(k, dim=-1)
            probs = top.softmax(dim=-1)
        else:
            probs, idx = logits.softmax(dim=-1).topk(k, dim=-1)
        return probs.to(x.dtype), idx

    def experts(self, h, L, capturable: bool = False):
        """The MoE MLP of ``h`` [..., hidden]: each token through its top-k experts, weighted by the router.

        Few tokens (a decode step: tokens x k <= experts) read only the routed experts' weights, gathered
        by id (no host synchronisation, so a CUDA graph can capture it): the step's weight bytes are the
        active experts', which is what the bandwidth bound counts. More tokens (a prefill) run each expert
        once on the tokens routed to it; ``capturable`` (the engine's graphed decode step of many rows) runs
        every expert on every token instead, weighted by the router (zero off the top k): no host sync, each
        expert's weights read once.
        """
        import torch
        import torch.nn.functional as F

        shape = h.shape
        x = h.reshape(-1, shape[-1])
        probs, idx = self.route(x, L["router_w"])
        n, k = idx.shape
        w1, w2 = L["experts_fc1"], L["experts_fc2"]  # [E, 2f, h], [E, h, f]
        if n * k <= w1.shape[0]:
            a = torch.einsum("nh,nkfh->nkf", x, w1[idx])
            a1, a2 = a.chunk(2, dim=-1)
            y = torch.einsum("nkf,nkhf->nkh", F.silu(a1) * a2, w2[idx])
            return (y * probs[..., None]).sum(dim=1).reshape(shape)
        if capturable:
            a1, a2 = torch.einsum("nh,efh->nef", x, w1).chunk(2, dim=-1)
            y = torch.einsum("nef,ehf->neh", F.silu(a1) * a2, w2)
            weight = torch.zeros(n, w1.shape[0], dtype=probs.dtype, device=x.device).scatter(1, idx, probs)
            return torch.einsum("neh,ne->nh", y, weight).reshape(shape)
        out = torch.zeros_like(x)
        for e in range(w1.shape[0]):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel():
                a1, a2 = F.linear(x[rows], w1[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(a1) * a2, w2[e])
                out.index_add_(0, rows, y * probs[rows, slot, None])
        return out.reshape(shape)

    def _norm(self, x, w, b):
        import torch.nn.functional as F

        if self.arch["normalization"] == "RMSNorm":
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        return F.layer_norm(x, (x.shape[-1],), w, b, self.eps)

    def qk_norm(self, qkv, L):
        """``qkv`` [..., g, per + 2, d] with each query head and the key normalised over the head (QK-norm,
        megatron-core's ``q_layernorm`` / ``k_layernorm``, before RoPE); as it is for a model without."""
        import torch

        if L["qn_w"] is None:
            return qkv
        per = qkv.shape[-2] - 2
        q = self._norm(qkv[..., :per, :], L["qn_w"], L["qn_b"])
        k = self._norm(qkv[..., per : per + 1, :], L["kn_w"], L["kn_b"])
        return torch.cat((q, k, qkv[..., per + 1 :, :]), dim=-2)

    def _rotate(self, t, cos, sin):
        import torch

        t1, t2 = t.chunk(2, dim=-1)
        return t * cos + torch.cat((-t2, t1), dim=-1) * sin

    def new_cache(self, batch: int, length: int):
        import torch

        shape = (len(self.layers), 2, batch, self.g, length, self.d)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def forward(self, tokens, positions, cache, start: int, key_valid, last_only: bool = False):
        """Logits [b, t, vocab] (fp32) of ``tokens`` [b, t] written at cache slots start..start+t-1.

        ``key_valid`` [b, start+t] marks the slots that hold real tokens; ``last_only``: logits of the
        last position only ([b, 1, vocab]: a long prompt's prefill never holds [b, t, vocab]).
        """
        import torch
        import torch.nn.functional as F

        b, t = tokens.shape
        x = F.embedding(tokens, self.emb)
        if self.virtual is not None and start == 0:
            n = self.virtual.size(0)
            prefix = (positions < n)[..., None]
            x = torch.where(prefix, self.virtual[positions.clamp(max=n - 1)], x)
        if self.pos_emb is not None:
            x = x + F.embedding(positions, self.pos_emb)
        if self.rope:
            freqs = positions.float()[..., None] * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [b, t, 1, d]
            cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        end = start + t
        slots = torch.arange(end, device=self.device)
        causal = slots[None, :] <= (start + torch.arange(t, device=self.device))[:, None]  # [t, end]
        mask = (causal[None] & key_valid[:, None, :end])[:, None]  # [b, 1, t, end]
        # a padding query sees no real key; let it see itself so that softmax has no empty row
        mask = mask | (slots[None, None, None, :] == (start + torch.arange(t, device=self.device))[None, None, :, None])
        n, g, d = self.n, self.g, self.d
        per = n // g
        swiglu = self.arch["activation"] == "swiglu"
        for li, L in enumerate(self.layers):
            h = self._norm(x, L["ln1_w"], L["ln1_b"])
            qkv = self.qk_norm(F.linear(h, L["qkv_w"], L["qkv_b"]).view(b, t, g, per + 2, d), L)
            q = qkv[:, :, :, :per].reshape(b, t, n, d)
            k = qkv[:, :, :, per]
            v = qkv[:, :, :, per + 1]
            if self.rope:
                q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            cache[li, 0, :, :, start:end] = k.transpose(1, 2)
            cache[li, 1, :, :, start:end] = v.transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                cache[li, 0, :, :, :end],
                cache[li, 1, :, :, :end],
                attn_mask=mask,
                enable_gqa=per > 1,
            )
            x = x + F.linear(o.transpose(1, 2).reshape(b, t, n * d), L["proj_w"], L["proj_b"])
            h = self._norm(x, L["ln2_w"], L["ln2_b"])
            if self.moe:
                x = x + self.experts(h, L)
                continue
            h = F.linear(h, L["fc1_w"], L["fc1_b"])
            if swiglu:
                a1, a2 = h.chunk(2, dim=-1)
                h = F.silu(a1) * a2
            else:
                h = F.gelu(h)
            x = x + F.linear(h, L["fc2_w"], L["fc2_b"])
        if last_only:
            x = x[:, -1:]
        x = self._norm(x, self.final_w, self.final_b)
        return F.linear(x, self.out)[..., : self.vocab_size].float()  # aligned rows for cuBLAS (the engine's _head)


# ----------------------------------------------------------------------------- sampling


def _expert_stacks(model, layer: int, experts: int) -> dict[str, Any]:
    """Layer ``layer``'s router and its experts' weights stacked ([E, 2f, h], [E, h, f]) for the decoder.

    The stacks become the model's storage: each expert's parameter is re-pointed to its slice, so the
    decoder holds no second copy of the experts (where training's gradient buffers own the parameters,
    ``main_grad``, the stacks are copies instead).
    """
    import torch

    p = f"decoder.layers.{layer}.mlp."
    out: dict[str, Any] = {"router_w": model.get_parameter(p + "router.weight")}
    for key, name in (("experts_fc1", "linear_fc1.weight"), ("experts_fc2", "linear_fc2.weight")):
        params = [model.get_parameter(f"{p}experts.local_experts.{e}.{name}") for e in range(experts)]
        with torch.no_grad():
            stack = torch.stack([q.data for q in params])
            if not any(hasattr(q, "main_grad") for q in params):
                for e, q in enumerate(params):
                    q.data = stack[e]
        out[key] = stack
    return out


def _filter(logits, top_k: int, top_p: float):
    import torch

    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        s, idx = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(s, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(s, dim=-1) >= top_p  # tokens after the nucleus is complete
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits


@dataclass
class _Run:
    """The device state of one :meth:`Generator.generate` call: left-padded rows, cache, what was drawn."""

    batch: list[list[int]]
    dev: Any
    eod: int
    longest: int
    pad: Any  # [b] padding slots before each row's first token
    tokens: Any  # [b, longest + max_new_tokens]
    valid: Any  # [b, same]: slots holding real tokens
    cache: Any
    gen: Any  # torch.Generator (seeded)
    seen: Any  # [b, vocab] tokens in the row (repetition penalty)
    counts: Any  # [b, vocab] fp32: how often each token was generated (presence/frequency penalties), or None
    bias: Any  # [vocab] fp32: logit_bias, or None
    done: Any
    gen_ids: Any
    lengths: Any
    reason: Any  # 0 length, 1 eod, 2 end string
    gen_lp: Any  # [b, max_new_tokens] log p of the drawn tokens, or None
    last: Any = None  # the current step's logits [b, vocab]
    full_steps: list[Any] = field(default_factory=list)
    p_lp: list[list[float]] = field(default_factory=list)

    @classmethod
    def start(cls, decoder: Decoder, batch: list[list[int]], params: SamplingParams, vocab: int, eod: int) -> _Run:
        import torch

        dev = decoder.device
        b = len(batch)
        longest = max(map(len, batch))
        total = longest + params.max_new_tokens
        pad = torch.tensor([longest - len(x) for x in batch], device=dev)
        tokens = torch.zeros(b, total, dtype=torch.long, device=dev)
        for i, ids in enumerate(batch):
            tokens[i, longest - len(ids) : longest] = torch.tensor(ids, dtype=torch.long)
        valid = torch.zeros(b, total, dtype=torch.bool, device=dev)
        valid[:, :longest] = torch.arange(longest, device=dev)[None, :] >= pad[:, None]
        gen = torch.Generator(device=dev)
        if params.seed is not None:
            gen.manual_seed(int(params.seed))
        else:
            gen.seed()
        seen = torch.zeros(b, vocab, dtype=torch.bool, device=dev)
        if params.repetition_penalty != 1.0:
            for i, ids in enumerate(batch):
                seen[i, torch.tensor(ids, device=dev)] = True
        counts = None
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            counts = torch.zeros(b, vocab, device=dev)
        bias = None
        if params.logit_bias:
            bias = torch.zeros(vocab, device=dev)
            bias[torch.tensor(list(params.logit_bias), device=dev)] = torch.tensor(
                [float(v) for v in params.logit_bias.values()], device=dev
            )
        n_new = params.max_new_tokens
        want_lp = params.logprobs or params.all_probs
        return cls(
            batch=batch,
            dev=dev,
            eod=eod,
            longest=longest,
            pad=pad,
            tokens=tokens,
            valid=valid,
            cache=decoder.new_cache(b, total),
            gen=gen,
            seen=seen,
            counts=counts,
            bias=bias,
            done=torch.zeros(b, dtype=torch.bool, device=dev),
            gen_ids=torch.full((b, max(n_new, 1)), eod, dtype=torch.long, device=dev),
            lengths=torch.full((b,), n_new, dtype=torch.long, device=dev),
            reason=torch.zeros(b, dtype=torch.long, device=dev),
            gen_lp=torch.zeros(b, max(n_new, 1), device=dev) if want_lp else None,
            p_lp=[[] for _ in range(b)],
        )


class Generator:
    """Prompts in, completions out, for one loaded model (not thread-safe: callers serialise)."""

    def __init__(self, model, arch: dict[str, Any], tokenizer, vocab_size: int | None = None, virtual=None) -> None:
        """``virtual``: p-tuning's prompt table [N, h] (prompts then start with N placeholder ids)."""
        self.tok = tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.decoder = Decoder(model, arch, self.vocab_size, virtual)
        self.arch = arch

    def encode(self, prompts: Sequence[str | Sequence[int]], add_bos: bool = False) -> list[list[int]]:
        out = []
        for p in prompts:
            ids = self.tok.encode(p) if isinstance(p, str) else [int(i) for i in p]
            out.append(([bos_id(self.tok)] if add_bos else []) + ids)
        return out

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams,
        add_bos: bool = False,
        prompt_logprobs: bool = False,
        on_step: Callable[[int, Any, Any], None] | None = None,
    ) -> list[Completion]:
        """``on_step(step, tokens, done)``, if given, sees each step's tokens [b] and which rows have ended [b]
        (device tensors); the server streams from it, and an exception raised there ends the generation."""
        import torch

        params.check()
        batch = self.encode(prompts, add_bos)
        if not batch:
            return []
        self._check_batch(batch, params)
        run = _Run.start(self.decoder, batch, params, self.vocab_size, self.tok.eod_id)
        with torch.inference_mode():
            self._prefill(run, prompt_logprobs)
            self._decode(run, params, on_step)
        return self._completions(run)

    def _check_batch(self, batch: list[list[int]], params: SamplingParams) -> None:
        """Every prompt has tokens, inside the vocabulary, and leaves room for the new ones."""
        params.check_vocab(self.vocab_size)
        for i, ids in enumerate(batch):
            if not ids:
                raise GenerationError(f"prompt {i} is empty (no tokens); set add_BOS or give some text", "sentences")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise GenerationError(
                    f"prompt {i}: token id {bad[0]} outside the vocabulary of {self.vocab_size}", "sentences"
                )
        longest = max(map(len, batch))
        # the last new token is never fed back, so prompt + new tokens may be one more than the positions
        if longest > self.decoder.max_len or longest + params.max_new_tokens > self.decoder.max_len + 1:
            raise GenerationError(
                f"tokens_to_generate: a prompt of {longest} tokens + {params.max_new_tokens} new tokens exceeds the "
                f"model's sequence length {self.decoder.max_len}",
                "tokens_to_generate",
            )

    def _prefill(self, run: _Run, prompt_logprobs: bool) -> None:
        """The prompts' forward: fills the cache, the first step's logits and (when asked) the prompts' log p."""
        import torch

        longest, pad, tokens = run.longest, run.pad, run.tokens
        positions = (torch.arange(longest, device=run.dev)[None, :] - pad[:, None]).clamp(min=0)
        logits = self.decoder.forward(
            tokens[:, :longest], positions, run.cache, 0, run.valid, last_only=not prompt_logprobs
        )
        if prompt_logprobs:
            lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:longest, None])[..., 0]
            for i, ids in enumerate(run.batch):
                run.p_lp[i] = lp[i, longest - len(ids) :].tolist()
        run.last = logits[:, -1]

    def _next_tokens(self, run: _Run, params: SamplingParams, step: int) -> Any:
        """One sampling step over the last logits: bias and penalties, EOD ban, greedy or filtered draw."""
        import torch

        from snakellm.serve.engine.sampling import penalize

        rp = params.repetition_penalty
        scores = penalize(
            run.last,
            run.bias,
            run.seen if rp != 1.0 else None,
            rp,
            run.counts,
            params.frequency_penalty,
            params.presence_penalty,
        )
        if step < params.min_new_tokens:
            scores = scores.clone()
            scores[:, run.eod] = float("-inf")
        if params.greedy:
            nxt = scores.argmax(dim=-1)
        else:
            s = _filter(scores / params.temperature, params.top_k, params.top_p)
            nxt = torch.multinomial(torch.softmax(s, dim=-1), 1, generator=run.gen)[:, 0]
        return torch.where(run.done, torch.full_like(nxt, run.eod), nxt)

    def _decode(
        self, run: _Run, params: SamplingParams, on_step: Callable[[int, Any, Any], None] | None = None
    ) -> None:
        """Sample ``max_new_tokens`` (fewer when every row stopped), one cached forward a token.

        Everything per step stays on the device; the host looks only for end strings (which need
        text) and, every few steps, whether all rows are done: no GPU sync per token.
        """
        import torch

        n_new, b = params.max_new_tokens, len(run.batch)
        ends = [s for s in params.end_strings if s]
        rows = torch.arange(b, device=run.dev)
        cur = run.longest
        for step in range(n_new):
            nxt = self._next_tokens(run, params, step)
            run.gen_ids[:, step] = nxt
            if run.gen_lp is not None:
                lsm = torch.log_softmax(run.last, dim=-1)
                run.gen_lp[:, step] = lsm.gather(-1, nxt[:, None])[:, 0]
                if params.all_probs:
                    run.full_steps.append(lsm.cpu())
            if params.stop_at_eod and step >= params.min_new_tokens:
                newly = ~run.done & (nxt == run.eod)
                run.lengths = torch.where(newly, step + 1, run.lengths)
                run.reason = torch.where(newly, 1, run.reason)
                run.done = run.done | newly
            if ends:
                host_done = run.done.tolist()
                recent = run.gen_ids[:, max(0, step - 31) : step + 1].tolist()
                for i in range(b):
                    if not host_done[i] and any(e in self.tok.decode(recent[i]) for e in ends):
                        run.lengths[i], run.reason[i], run.done[i] = step + 1, 2, True
            if params.repetition_penalty != 1.0:
                run.seen[rows, nxt] = True
            if run.counts is not None:
                run.counts[rows, nxt] += 1.0
            if on_step is not None:
                on_step(step, nxt, run.done)
            if step == n_new - 1 or ((ends or step % 8 == 7) and bool(run.done.all())):
                break
            run.tokens[:, cur] = nxt
            run.valid[:, cur] = True
            positions = (cur - run.pad)[:, None]
            run.last = self.decoder.forward(run.tokens[:, cur : cur + 1], positions, run.cache, cur, run.valid)[:, -1]
            cur += 1

    def _completions(self, run: _Run) -> list[Completion]:
        import torch

        n = run.lengths.tolist()
        ids_host = run.gen_ids.tolist()
        why = [("length", "eod", "end_string")[r] for r in run.reason.tolist()]
        lp_host = run.gen_lp.tolist() if run.gen_lp is not None else None
        full = torch.stack(run.full_steps, dim=1) if run.full_steps else None  # [b, steps, V]
        batch = run.batch
        return [
            Completion(
                batch[i],
                ids_host[i][: n[i]],
                self.continuation(batch[i], ids_host[i][: n[i]]),
                why[i],
                lp_host[i][: n[i]] if lp_host else [],
                run.p_lp[i],
                full[i, : n[i]].tolist() if full is not None else None,
            )
            for i in range(len(batch))
        ]

    def continuation(self, prompt: Sequence[int], ids: Sequence[int]) -> str:
        """The text ``ids`` add after ``prompt`` (decoded in context: a leading space is kept)."""
        if not ids:
            return ""
        head = self.tok.decode(list(prompt))
        full = self.tok.decode(list(prompt) + list(ids))
        return full[len(head) :] if full.startswith(head) else self.tok.decode(list(ids))

    def score(self, rows: Sequence[Sequence[int]], full: bool = False) -> tuple[list[list[float]], list | None]:
        """log p(token_i | tokens_<i) for i >= 1 of each row (one forward, no sampling); all vocab rows if ``full``."""
        import torch

        dev = self.decoder.device
        longest = max(map(len, rows))
        b = len(rows)
        tokens = torch.zeros(b, longest, dtype=torch.long, device=dev)
        pad = torch.tensor([longest - len(r) for r in rows], device=dev)
        for i, r in enumerate(rows):
            tokens[i, longest - len(r) :] = torch.tensor(list(r), dtype=torch.long)
        valid = torch.arange(longest, device=dev)[None, :] >= pad[:, None]
        with torch.inference_mode():
            positions = (torch.arange(longest, device=dev)[None, :] - pad[:, None]).clamp(min=0)
            logits = self.decoder.forward(tokens, positions, self.decoder.new_cache(b, longest), 0, valid)
            lsm = torch.log_softmax(logits[:, :-1], dim=-1)
            chosen = lsm.gather(-1, tokens[:, 1:, None])[..., 0]
        lps = [chosen[i, longest - len(r) :].tolist() for i, r in enumerate(rows)]
        fulls = [lsm[i, longest - len(r) :].tolist() for i, r in enumerate(rows)] if full else None
        return lps, fulls


def check_fits_one_gpu(arch: dict[str, Any], padded_vocab: int, bytes_per_param: int, capacity: int | None) -> None:
    """Refuse, before loading, a model whose weights alone overflow the GPU: the engine (``generate``,
    ``serve``, ``evaluate``) runs one model on one GPU and has no tensor parallelism. ``capacity``: the
    GPU's bytes (None: the CPU, no check)."""
    from snakellm.models.counts import param_count

    if capacity is None:
        return
    need = param_count(arch, padded_vocab) * bytes_per_param
    if need > 0.95 * capacity:
        raise GenerationError(
            f"the model's weights are {need / 2**30:.1f} GiB and the GPU holds {capacity / 2**30:.1f} GiB: the "
            "generation engine (snakellm generate / serve / evaluate) runs on one GPU and has no tensor "
            "parallelism (finetune.<name>.parallel.tp applies to training only); use a GPU with more memory",
            "tensor_parallel",
        )


def gpu_capacity(device: Any) -> int | None:
    """Total bytes of the CUDA device ``device`` (None for the CPU)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(dev.index or 0).total_memory)


def load_generator(
    checkpoint: str,
    *,
    blend: str | None = None,
    device: str = "auto",
    bf16: bool | None = None,
    iteration: int | None = None,
) -> Generator:
    """A :class:`Generator` for a run's checkpoint (the tokenizer from its run_config, or ``blend``)."""
    import torch

    from snakellm.export.hf import tokenizer_from_blend
    from snakellm.models.loading import describe_run, load

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    info = describe_run(checkpoint, iteration)
    tok_block = tokenizer_from_blend(blend) if blend else info["tokenizer"]
    tok = load_tokenizer(tok_block, tokenizer_base(tok_block, Path(info["run_dir"])))
    if bf16 is None:
        bf16 = device.startswith("cuda")
    check_fits_one_gpu(info["arch"], info["padded_vocab_size"], 2 if bf16 else 4, gpu_capacity(device))
    loaded = load(info["checkpoint_dir"], info["iteration"], device=device, bf16=bf16)
    return Generator(loaded.model, loaded.arch, tok, int(tok_block.get("vocab_size") or tok.vocab_size))


def tokenizer_base(block: dict[str, Any], run_dir: Path) -> Path | None:
    """Where a run's relative tokenizer paths resolve when the working directory is elsewhere.

    A workflow records them relative to its directory (``tokenizers/spm2k/tokenizer.model``), which
    holds ``runs/NAME``; a run that carries its tokenizer, relative to the run. The first directory
    in which every relative file exists; None (the working directory) if none.
    """
    rel = [Path(f) for f in (block.get("files") or {}).values() if not Path(f).is_absolute()]
    if not rel or all(f.exists() for f in rel):
        return None
    for base in (run_dir, run_dir.parent.parent):
        if all((base / f).exists() for f in rel):
            return base
    return None


# ----------------------------------------------------------------------------- snakellm generate


def params_summary(p: SamplingParams) -> str:
    if p.greedy:
        how = "greedy"
    else:
        how = f"temperature {p.temperature}, top-k {p.top_k}, top-p {p.top_p}, seed {p.seed}"
    pen = f"repetition penalty {p.repetition_penalty}"
    if p.presence_penalty or p.frequency_penalty:
        pen += f", presence penalty {p.presence_penalty}, frequency penalty {p.frequency_penalty}"
    return f"{how}, {pen}, {p.min_new_tokens}-{p.max_new_tokens} new tokens"
