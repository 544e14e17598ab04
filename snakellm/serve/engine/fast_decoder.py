"""The decode step over a static KV cache, captured in CUDA graphs per (batch, length) bucket.

:class:`FastDecoder` runs the eager :class:`~snakellm.serve.generate.Decoder`'s
weights and computation (it reads them from that object: one description of
the model) with two changes of shape that make the decode step capturable:

* every batch row owns one row of a :class:`StaticKVCache`, starting at slot 0;
  a step feeds one token per row at that row's own position (``pos``), so rows
  of different lengths need no padding and a request can join or leave between
  two steps;
* the step reads and writes only static buffers (``tokens``, ``pos``,
  ``active``, the cache, the sampler's state) and samples on the device, so
  one CUDA graph per bucket replays it with a single launch from Python.

Buckets: the batch is the first ``B`` rows (``B`` a power of two covering the
highest row in use; idle rows compute and are ignored) and attention reads the
first ``L`` cache slots (a power of two covering the longest row). Graphs are
captured on first use, with the row positions parked on the cache's spare slot
and the sampler's state restored afterwards, so capturing while requests run
changes none of them. On the CPU (or with graphs off) the same step runs eagerly:
the tests compare it with the eager decoder there.

The prefill of joining requests is one batched forward (right-padded, causal
SDPA: a row's real tokens never see its padding) that writes the rows' cache
slots 0..len-1 and samples each row's first token.
"""

from __future__ import annotations

from typing import Any

from snakellm.serve.engine.sampling import SamplingState
from snakellm.serve.engine.static_cache import CacheShape, StaticKVCache

FUSED_MAX_ROWS = 32  # kernels.MAX_ROWS, without importing Triton
ATTEND_MAX_LEN = 1024  # cache slots the fused attention kernel reads (one program per row and group); SDPA beyond


def fused_kernels_usable(decoder: Any) -> bool:
    """Whether the fused Triton step can run for ``decoder``: a 16-bit model on CUDA, Triton installed."""
    import importlib.util

    import torch

    sixteen = decoder.dtype in (torch.bfloat16, torch.float16)
    if getattr(decoder, "moe", False):
        return False  # the kernels fuse a dense MLP; a mixture of experts runs the decoder's routed experts
    return decoder.device.type == "cuda" and sixteen and importlib.util.find_spec("triton") is not None


def padded(prompts: list[list[int]], rows: int, length: int) -> Any:
    """The prompts as a right-padded (zeros) host tensor [rows, length]; rows past the prompts are zeros."""
    import torch

    tokens = torch.zeros(rows, length, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    return tokens


def buckets(limit: int, start: int) -> list[int]:
    """Powers of two from ``start`` below ``limit``, then ``limit`` itself."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


def pick(bucket_list: list[int], need: int) -> int:
    return next(b for b in bucket_list if b >= need)


class FastDecoder:
    """Static-cache decoding for up to ``rows`` requests of up to ``max_len`` tokens each."""

    def __init__(
        self,
        decoder: Any,
        rows: int,
        max_len: int,
        eod: int,
        *,
        graphs: bool,
        compile: bool = False,
        fused: int = 0,
    ) -> None:
        import torch

        self.dec = decoder
        self.device = decoder.device
        self.rows = rows
        self.max_len = max_len
        self.vocab = decoder.vocab_size
        self.per = decoder.n // decoder.g
        shape = CacheShape(len(decoder.layers), decoder.g, decoder.d, max_len, decoder.emb.element_size())
        self.graphs_on = graphs and self.device.type == "cuda"
        # with graphs, one spare row (index ``rows``) takes the padding rows of a bucketed prefill
        self.cache = StaticKVCache(shape, rows + self.graphs_on, decoder.dtype, self.device)
        dev, i64 = self.device, torch.long
        self.tokens = torch.zeros(rows, dtype=i64, device=dev)
        self.pos = torch.full((rows,), max_len, dtype=i64, device=dev)
        self.active = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.row_ids = torch.arange(rows, dtype=i64, device=dev)
        self.out_tokens = torch.zeros(rows, dtype=i64, device=dev)
        self.out_logprobs = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.logits = torch.zeros(rows, self.vocab, dtype=torch.float32, device=dev)
        self.sampler = SamplingState(rows, self.vocab, eod, dev)
        self.cos: Any = None
        self.sin: Any = None
        if decoder.rope:
            self.cos, self.sin = self._rope_table(max_len + 1)
            self.qkv_cos, self.qkv_sin = self._qkv_rope_table()
        self.batch_buckets = buckets(rows, 1)
        self.length_buckets = buckets(max_len, 64)
        self.prefill_buckets = buckets(max_len, 16)
        self.compile = compile and self.graphs_on
        # fused Triton kernels (kernels.py) for batch buckets of up to this many rows; larger ones are PyTorch ops
        self.fused = fused
        self.graphs: dict[tuple[int, int, bool, bool, bool], Any] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.graphs_on else None
        self.prefill_graphs: dict[tuple[int, int], Any] = {}
        if self.graphs_on:  # the graphed prefill's static inputs and output
            self.pf_tokens = torch.zeros(rows, max_len, dtype=i64, device=dev)
            self.pf_lengths = torch.ones(rows, dtype=i64, device=dev)
            self.pf_slots = torch.zeros(rows, dtype=i64, device=dev)
            self.pf_logits = torch.zeros(rows, self.vocab, dtype=torch.float32, device=dev)
        self._compiled: dict[tuple[int, int, bool, bool, bool], Any] = {}

    def _rope_table(self, n: int) -> tuple[Any, Any]:
        """cos/sin [n, d] in the model's dtype, computed as the eager decoder computes them per step."""
        import torch

        freqs = torch.arange(n, device=self.device).float()[:, None] * self.dec.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dec.dtype), emb.sin().to(self.dec.dtype)

    def _qkv_rope_table(self) -> tuple[Any, Any]:
        """cos and signed sin [max_len + 1, per + 2, d] for one group's q heads, k and v (cos 1, sin 0).

        With these, one ``addcmul(t * cos, flip(t), sin)`` rotates a group's queries and key and
        leaves its value as it is (v * 1 + 0): the eager ``t * cos + cat(-t2, t1) * sin`` in three
        kernels for the whole ``[q, k, v]`` block, which then goes to the cache in one write.
        """
        import torch

        half = self.dec.d // 2
        sin = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)
        heads = self.per + 2
        cos_t = self.cos[:, None, :].repeat(1, heads, 1)
        sin_t = sin[:, None, :].repeat(1, heads, 1)
        cos_t[:, -1] = 1
        sin_t[:, -1] = 0
        return cos_t, sin_t

    # ------------------------------------------------------------------ the layer stack

    def _embed(self, tokens: Any, positions: Any, prefill: bool) -> Any:
        import torch
        import torch.nn.functional as F

        dec = self.dec
        x = F.embedding(tokens, dec.emb)
        if prefill and dec.virtual is not None:
            n = dec.virtual.size(0)
            x = torch.where((positions < n)[..., None], dec.virtual[positions.clamp(max=n - 1)], x)
        if dec.pos_emb is not None:
            x = x + F.embedding(positions, dec.pos_emb)
        return x

    def _mlp(self, x: Any, L: dict[str, Any]) -> Any:
        import torch.nn.functional as F

        h = self.dec._norm(x, L["ln2_w"], L["ln2_b"])
        if self.dec.moe:  # routed experts; the decode step (one token a row) stays capturable in a CUDA graph
            return x + self.dec.experts(h, L, capturable=h.shape[:-1].numel() <= self.rows)
        h = F.linear(h, L["fc1_w"], L["fc1_b"])
        if self.dec.arch["activation"] == "swiglu":
            a1, a2 = h.chunk(2, dim=-1)
            h = F.silu(a1) * a2
        else:
            h = F.gelu(h)
        return self._residual(x, h, L["fc2_w"], L["fc2_b"])

    def _head(self, x: Any) -> Any:
        import torch.nn.functional as F

        dec = self.dec
        x = dec._norm(x, dec.final_w, dec.final_b)
        # the whole (padded) output matrix, then the vocabulary's columns: logits of an odd row length (GPT-2's
        # 50,257) leave cuBLAS only unaligned kernels (a 0.52 ms step of 32 rows at 8B on an H200 against 0.11)
        return F.linear(x, dec.out)[..., : self.vocab].float()

    # ------------------------------------------------------------------ prefill

    def prefill(self, rows: list[int], prompts: list[list[int]], want_all: bool = False) -> Any:
        """Write the prompts' keys/values into cache rows ``rows``; logits [n, V] of each last token.

        ``want_all``: logits [n, T, V] of every position instead (for prompt log-probabilities).
        With graphs on, the prefill of up to 4 prompts of up to 512 tokens is padded to a (rows,
        length) bucket and replayed from a CUDA graph: in eager PyTorch, a short prompt's prefill
        is hundreds of Python-launched kernels (20 ms for 128 tokens of llama-1b, as long as 20
        decode steps); larger ones keep the GPU busy as they are and would need many graphs.
        """
        import torch

        # a mixture of experts' prefill runs each expert on its tokens (data-dependent shapes): never graphed
        short = len(prompts) <= 4 and max(map(len, prompts)) <= 512 and not self.dec.moe
        if self.graphs_on and not want_all and short:
            return self._prefill_graphed(rows, prompts)
        dev = self.device
        tokens = padded(prompts, len(prompts), max(map(len, prompts)))
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        slot = torch.tensor(rows, dtype=torch.long, device=dev)
        return self._prefill_forward(tokens.to(dev), lengths, slot, want_all)

    def _prefill_forward(self, tokens: Any, lengths: Any, slot: Any, want_all: bool) -> Any:
        """The prefill of ``tokens`` [n, T] (right-padded to T) into cache rows ``slot`` [n]."""
        import torch
        import torch.nn.functional as F

        dec, dev = self.dec, self.device
        n, T = tokens.shape
        positions = torch.arange(T, device=dev)[None, :].expand(n, T)
        x = self._embed(tokens, positions, prefill=True)
        cos = sin = None
        if self.cos is not None:
            cos, sin = self.cos[:T][None, :, None, :], self.sin[:T][None, :, None, :]
        g, d, per = dec.g, dec.d, self.per
        for li, L in enumerate(dec.layers):
            h = dec._norm(x, L["ln1_w"], L["ln1_b"])
            qkv = dec.qk_norm(F.linear(h, L["qkv_w"], L["qkv_b"]).view(n, T, g, per + 2, d), L)
            q = qkv[:, :, :, :per].reshape(n, T, dec.n, d)
            k, v = qkv[:, :, :, per], qkv[:, :, :, per + 1]
            if cos is not None:
                q, k = dec._rotate(q, cos, sin), dec._rotate(k, cos, sin)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            self.cache.keys(li)[slot, :, :T] = k
            self.cache.values(li)[slot, :, :T] = v
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, enable_gqa=per > 1)
            x = x + F.linear(o.transpose(1, 2).reshape(n, T, dec.n * d), L["proj_w"], L["proj_b"])
            x = self._mlp(x, L)
        if want_all:
            return self._head(x)
        return self._head(x[torch.arange(n, device=dev), lengths - 1])

    def _prefill_graphed(self, rows: list[int], prompts: list[list[int]]) -> Any:
        """The prefill through a CUDA graph per (rows, length) bucket; padding rows write the spare row."""
        import torch

        n, T = len(prompts), max(map(len, prompts))
        Bb, Tb = pick(self.batch_buckets, n), pick(self.prefill_buckets, T)
        key = (Bb, Tb)
        graph = self.prefill_graphs.get(key)
        if graph is None:
            graph = self.prefill_graphs[key] = self._capture_prefill(Bb, Tb)
        self.pf_tokens[:Bb, :Tb].copy_(padded(prompts, Bb, Tb))
        self.pf_lengths[:Bb].copy_(torch.tensor([len(p) for p in prompts] + [1] * (Bb - n)))
        self.pf_slots[:Bb].copy_(torch.tensor(rows + [self.rows] * (Bb - n)))
        graph.replay()
        return self.pf_logits[:n].clone()

    def _capture_prefill(self, Bb: int, Tb: int) -> Any:
        """Warm up and capture the prefill of a (Bb, Tb) bucket; it writes only the spare cache row."""
        self.pf_slots[:Bb].fill_(self.rows)
        self.pf_lengths[:Bb].fill_(1)

        def fn() -> None:
            args = (self.pf_tokens[:Bb, :Tb], self.pf_lengths[:Bb], self.pf_slots[:Bb])
            self.pf_logits[:Bb].copy_(self._prefill_forward(*args, want_all=False))

        return self._graph(fn)

    def _graph(self, fn: Any) -> Any:
        """``fn`` warmed up twice on a side stream (autotuning and lazy allocations happen there), then
        captured into a CUDA graph in the decoder's pool."""
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        return graph

    def start_rows(
        self, rows: list[int], prompts: list[list[int]], logits: Any, greedy_only: bool = False, penalty: bool = True
    ) -> tuple[Any, Any]:
        """Sample each new row's first token from its prefill logits and arm the row for decode steps.

        ``greedy_only`` / ``penalty``: as in :meth:`SamplingState.sample` (all new rows greedy: no sort of
        the vocabulary, which costs 4 ms a row on a CPU for GPT-2's 50k tokens; no penalty: no pass).
        """
        import torch

        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        nxt, lp = self.sampler.sample(logits, idx, greedy_only, penalty)
        self.tokens[idx] = nxt
        self.pos[idx] = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self.device)
        self.active[idx] = True
        self.logits[idx] = logits
        return nxt, lp

    def stop_row(self, row: int) -> None:
        self.active[row] = False
        self.pos[row] = self.max_len

    # ------------------------------------------------------------------ the decode step

    def _step(self, B: int, Lb: int, greedy_only: bool, penalty: bool, probs: bool) -> None:
        """One token for rows 0..B-1: forward, sample, advance. Static shapes only (capturable).

        ``probs``: log-probabilities, and the logits kept (for a request that asked for every step's
        distribution).
        """
        import torch

        logits = self._logits_fused(B, Lb) if B <= self.fused else self._logits(B, Lb)
        pos, rows = self.pos[:B], self.row_ids[:B]
        nxt, lp = self.sampler.sample(logits, rows, greedy_only, penalty, probs)
        if probs:
            self.logits[:B].copy_(logits)
        self.out_tokens[:B].copy_(nxt)
        self.out_logprobs[:B].copy_(lp)
        self.tokens[:B].copy_(nxt)
        self.pos[:B].copy_(torch.clamp(pos + self.active[:B].long(), max=self.max_len))

    def _step_input(self, B: int) -> Any:
        """Embeddings [B, 1, h] of rows 0..B-1's current tokens at their positions."""
        # idle rows sit on the spare slot (pos = max_len): clamp for the learned position table
        pos = self.pos[:B].clamp(max=self.max_len - 1)
        return self._embed(self.tokens[:B, None], pos[:, None], prefill=False)

    def _logits(self, B: int, Lb: int) -> Any:
        """The step's logits [B, V] (fp32) through PyTorch ops: the eager decoder's computation.

        Where the fused kernels run (``fused`` > 0: a GPU), a batch too large for them still takes
        their attention kernel (RoPE, the cache write and attention in one launch instead of about
        six), with the matrix products on cuBLAS.
        """
        import torch.nn.functional as F

        dec = self.dec
        ctx = self._attention_context(B, Lb)
        x = self._step_input(B)[:, 0]
        for li, L in enumerate(dec.layers):
            qkv = F.linear(dec._norm(x, L["ln1_w"], L["ln1_b"]), L["qkv_w"], L["qkv_b"])
            x = self._residual(x, self._attention(qkv, li, B, Lb, ctx), L["proj_w"], L["proj_b"])
            x = self._mlp(x, L)
        return self._head(x)

    def _attention_context(self, B: int, Lb: int) -> tuple[Any, Any, Any] | None:
        """The PyTorch attention's per-step tensors (RoPE rows, mask), or None where the fused kernel runs.

        The kernel runs one program per (row, KV group) over the whole cache: up to ``ATTEND_MAX_LEN``
        slots; longer rows take SDPA, which splits the sequence.
        """
        import torch

        if self.fused > 0 and Lb <= ATTEND_MAX_LEN:
            return None
        pos = self.pos[:B]
        cos = sin = None
        if self.cos is not None:
            cos, sin = self.qkv_cos[pos][:, None, None], self.qkv_sin[pos][:, None, None]  # [B, 1, 1, per+2, d]
        mask = (torch.arange(Lb, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]
        return cos, sin, mask

    def _attention(self, qkv: Any, li: int, B: int, Lb: int, ctx: tuple[Any, Any, Any] | None) -> Any:
        """Attention output [B, n * d] of the step's ``qkv`` [B, g * (per + 2) * d] at layer ``li``,
        the new keys and values written to the cache (``ctx``: see :meth:`_attention_context`)."""
        import torch
        import torch.nn.functional as F

        pos = self.pos[:B]
        g, d, per = self.dec.g, self.dec.d, self.per
        L = self.dec.layers[li]
        if L["qn_w"] is not None:  # QK-norm (Qwen3) before RoPE, on the [q, k, v] block of each group
            qkv = self.dec.qk_norm(qkv.view(B, g, per + 2, d), L).view(B, g * (per + 2) * d)
        if ctx is None:
            from snakellm.serve.engine import kernels as K

            return K.attend(qkv, self.cache.data[li], pos, self.cos, self.sin, self.per, Lb)
        cos, sin, mask = ctx
        qkv = qkv.view(B, 1, g, per + 2, d)
        if cos is not None:
            flipped = qkv.view(B, 1, g, per + 2, 2, d // 2).flip(-2).view(B, 1, g, per + 2, d)
            qkv = torch.addcmul(qkv * cos, flipped, sin)
        kv = self.cache.data[li]  # [2, rows, g, max_len + 1, d]
        kv[:, self.row_ids[:B], :, pos] = qkv[:, 0, :, per:].transpose(1, 2)  # [B, 2, g, d]: k and v in one write
        q = qkv[:, 0, :, :per]  # [B, g, per, d]: a group's query heads attend together to its keys
        o = F.scaled_dot_product_attention(q, kv[0, :B, :, :Lb], kv[1, :B, :, :Lb], attn_mask=mask)
        return o.reshape(B, self.dec.n * d)

    def _logits_fused(self, B: int, Lb: int) -> Any:
        """The same logits through the fused kernels: five per layer (see :mod:`.kernels`)."""
        from snakellm.serve.engine import kernels as K

        dec = self.dec
        norm = K.RMSNORM if dec.arch["normalization"] == "RMSNorm" else K.LAYERNORM
        act = K.SWIGLU if dec.arch["activation"] == "swiglu" else K.GELU
        eps, ctx = dec.eps, self._attention_context(B, Lb)
        x = self._step_input(B)[:, 0]
        for li, L in enumerate(dec.layers):
            h = K.linear(x, L["qkv_w"], bias=L["qkv_b"], norm=norm, norm_w=L["ln1_w"], norm_b=L["ln1_b"], eps=eps)
            x = K.linear(self._attention(h, li, B, Lb, ctx), L["proj_w"], bias=L["proj_b"], residual=x)
            h = K.linear(
                x, L["fc1_w"], bias=L["fc1_b"], norm=norm, norm_w=L["ln2_w"], norm_b=L["ln2_b"], eps=eps, act=act
            )
            x = K.linear(h, L["fc2_w"], bias=L["fc2_b"], residual=x)
        out = dec.out[: self.vocab]
        return K.linear(x, out, norm=norm, norm_w=dec.final_w, norm_b=dec.final_b, eps=eps, out_f32=True)

    @staticmethod
    def _residual(x: Any, h: Any, w: Any, b: Any) -> Any:
        """``x + linear(h, w, b)``; without a bias the add rides in the matrix product (one kernel)."""
        import torch
        import torch.nn.functional as F

        if b is not None:
            return x + F.linear(h, w, b)
        return torch.addmm(x.reshape(-1, x.shape[-1]), h.reshape(-1, h.shape[-1]), w.t()).view(x.shape)

    def decode(self, highest_row: int, longest: int, greedy_only: bool, penalty: bool, probs: bool) -> None:
        """One decode step for rows 0..highest_row, the longest holding ``longest`` tokens after it.

        The flags choose the sampler's variant (see :meth:`SamplingState.sample`); each (batch bucket,
        length bucket, flags) is one graph.
        """
        B = pick(self.batch_buckets, highest_row + 1)
        Lb = pick(self.length_buckets, longest)
        if not self.graphs_on:
            self._step(B, Lb, greedy_only, penalty, probs)
            return
        key = (B, Lb, greedy_only, penalty, probs)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(key)
        graph.replay()

    def _fn(self, key: tuple[int, int, bool, bool, bool]) -> Any:
        """The step for ``key`` as a function of no arguments (torch.compile'd once per key if asked)."""
        import functools

        import torch

        fn = functools.partial(self._step, *key)
        if not self.compile:
            return fn
        if key not in self._compiled:
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
            self._compiled[key] = torch.compile(fn, fullgraph=True, dynamic=False)
        return self._compiled[key]

    def _capture(self, key: tuple[int, int, bool, bool, bool]) -> Any:
        """Warm up and capture the step for ``key`` without disturbing the rows in flight."""

        s = self.sampler
        state = [self.tokens, self.pos, self.active, self.out_tokens, self.out_logprobs]
        state += [s.n_gen, s.seen, s.counts, self.logits]
        saved = [t.clone() for t in state]
        self.pos.fill_(self.max_len)  # writes land on the spare slot while warming up
        self.active.zero_()
        graph = self._graph(self._fn(key))
        for t, v in zip(state, saved, strict=True):
            t.copy_(v)
        return graph
