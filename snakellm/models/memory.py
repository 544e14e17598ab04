"""GPU memory per rank before anything is submitted: weights, gradients, optimizer, activations.

Torch-free, from the architecture dict alone (``snakellm.models.architecture``), so
``snakellm plan`` can say whether a run fits before a 64-GPU job waits a day in the
queue to run out of memory.

Model states (Megatron-LM's accounting, ``docs/source/api-guide/dist_optimizer.md``):
bf16 weights (2 bytes a parameter), fp32 gradient buffers (4, ``grad_reduce_in_fp32``
as snakellm trains), and the Adam states in fp32: master weights, first and second
moments (12). Without the distributed optimizer that is 18 bytes a parameter; with
it the 12 are sharded over the data-parallel ranks: ``6 + 12 / dp``. fp32 training
has no masters: 4 + 4 + 8. Tensor-parallel layers hold ``1/tp`` of their weights;
norms (and the row-parallel layers' biases) are replicated.

Activations: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (2022), section 4: a GPT layer keeps ``s b h (34 + 5 a s / h)`` bytes with 16-bit
activations, ``s b h (10 + 24/t + 5 a s / (h t))`` under tensor parallelism of size t,
and ``s b h (34/t + 5 a s / (h t))`` with sequence parallelism as well. The terms are
counted here one stored tensor at a time, so the same derivation covers grouped-query
attention (K and V are ``h * groups / heads`` wide), SwiGLU (the up projection is ``2 f``
wide), models without dropout (no masks) and fused attention kernels (flash/cuDNN keep
no ``s x s`` scores, only a float32 log-sum-exp per query and head). For GPT shapes
with dropout and unfused attention the numbers are exactly the paper's; the unit tests
check that. With pipeline parallelism of size p, 1F1B keeps p micro-batches in flight
on the first stage, whose ``L / p`` layers then hold ``L`` layers' worth (the paper's
observation); the output layer's logits (16-bit, plus the float32 copy the loss makes)
are counted on the last stage, which for p = 1 is the same GPU.

Not counted: the CUDA context and library workspaces (about 1-3 GiB per GPU), the
allocator's fragmentation, communication buffers, and temporary tensors of a single
kernel. The estimate is a floor; leave headroom.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from snakellm.models.families.base import head_dim

GiB = 1024**3
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU (the fullest pipeline stage); ``params`` is that GPU's parameter count."""

    params: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    distributed_optimizer: bool
    sequence_parallel: bool
    recompute: str
    virtual_pp: int = 1
    fsdp: bool = False
    ep: int = 1

    @property
    def model_states(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations

    def lines(self, gpu_gib: float | None = None) -> list[str]:
        """The human-readable table ``snakellm plan`` prints."""
        opt = (
            "FSDP: parameters, gradients and optimizer sharded"
            if self.fsdp
            else ("distributed optimizer" if self.distributed_optimizer else "optimizer replicated")
        )
        out = [
            f"memory per GPU (tp {self.tp} x pp {self.pp} x dp {self.dp}, micro batch {self.micro_batch_size}, "
            f"{opt}, sequence parallel {'on' if self.sequence_parallel else 'off'}, recompute {self.recompute}"
            + (f", {self.virtual_pp} virtual stages" if self.virtual_pp > 1 else "")
            + (f", experts over ep {self.ep}" if self.ep > 1 else "")
            + "):",
            f"  weights      {self.weights / GiB:8.2f} GiB  ({self.params / 1e6:,.1f}M parameters on this GPU)",
            f"  gradients    {self.grads / GiB:8.2f} GiB",
            f"  optimizer    {self.optimizer / GiB:8.2f} GiB",
            f"  activations  {self.activations / GiB:8.2f} GiB",
            f"  total        {self.total / GiB:8.2f} GiB  (+ ~1-3 GiB CUDA context and workspaces, not counted)",
        ]
        if gpu_gib:
            verdict = "fits" if self.total / GiB <= 0.9 * gpu_gib - 2 else "does NOT fit"
            out.append(f"  {verdict} in {gpu_gib:g} GiB GPUs (with 10% + 2 GiB headroom)")
        return out


def layer_params(arch: dict[str, Any], tp: int = 1, ep: int = 1) -> tuple[float, float]:
    """``(sharded, replicated)`` parameters of one transformer layer on one tensor-parallel rank.

    Column-parallel QKV and up projections and row-parallel output projections are
    split over ``tp`` (with their biases, except the row-parallel ones' which are
    replicated); norms are replicated. A mixture of experts holds ``num_experts / ep`` experts
    (each split over ``tp``) and the whole router (replicated).
    """
    h, f = arch["hidden_size"], arch["ffn_hidden_size"]
    d = head_dim(arch)
    q, kv = arch["num_attention_heads"] * d, arch["num_query_groups"] * d
    bias = bool(arch["bias"])
    qkv_bias = bool(arch.get("qkv_bias", bias))
    norm = 2 * h if arch["normalization"] == "LayerNorm" else h
    up = 2 * f if arch["activation"] == "swiglu" else f
    mlp = h * up + f * h + (up if bias else 0)
    router = 0
    if arch.get("num_experts"):
        from snakellm.models.moe import expert_params

        mlp, router = arch["num_experts"] // ep * expert_params(arch), arch["num_experts"] * h
    sharded = h * (q + 2 * kv) + q * h + mlp + ((q + 2 * kv) if qkv_bias else 0)
    replicated = 2 * norm + (2 * h if bias else 0) + (2 * d if arch.get("qk_norm") else 0) + router
    return sharded / tp, float(replicated)


def layer_activation_bytes(
    arch: dict[str, Any],
    micro_batch_size: int,
    *,
    seq_length: int | None = None,
    tp: int = 1,
    sequence_parallel: bool = False,
    flash_attention: bool = True,
    recompute: str = "none",
    bytes_per_element: int = 2,
    fused_swiglu: bool = True,
) -> float:
    """Bytes one transformer layer keeps for its backward pass, per micro-batch, on one tensor-parallel rank.

    ``fused_swiglu``: megatron-core's fused SwiGLU (every GPU run) rather than the CPU's unfused one.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    s, b, e = seq_length or arch["seq_length"], micro_batch_size, bytes_per_element
    h, f, a = arch["hidden_size"], arch["ffn_hidden_size"], arch["num_attention_heads"]
    q, kv = a * head_dim(arch), head_dim(arch) * arch["num_query_groups"]  # q = h unless the head size is its own
    sbh = s * b * h
    hidden_dropout = (arch.get("hidden_dropout") or 0) > 0
    attn_dropout = (arch.get("attention_dropout") or 0) > 0
    rep_div = tp if sequence_parallel else 1
    if recompute == "full":  # only the layer's input is kept; the layer is recomputed in the backward pass
        return e * sbh / rep_div
    # outside the tensor-parallel regions: the two norms' inputs, their outputs (the QKV and MLP inputs),
    # and the 1-byte dropout masks after attention and after the MLP
    replicated = 4 * e * sbh + (2 * sbh if hidden_dropout else 0)
    # inside them, split over tp: Q and K (for Q K^T), V, the attention output (input of the output
    # projection), and the MLP's up-projection output and down-projection input. An unfused SwiGLU
    # (the CPU's) keeps one more f-wide tensor, SiLU(gate), the product's other factor (measured on
    # H200s at 8B before GPUs fused it: without it the estimate was 12% under the peak of a stage that
    # keeps 24 layers' activations); on a GPU megatron-core's fused SwiGLU keeps only its input
    swiglu = arch["activation"] == "swiglu"
    up = 2 * f if swiglu else f
    mlp = e * s * b * up + e * s * b * f
    if arch.get("num_experts"):  # each token's top-k copies: the experts' input, up-projection and down input,
        k, fe = arch["moe_router_topk"], arch["moe_ffn_hidden_size"]  # and the dispatcher's permuted tokens
        up, f = (2 * fe if swiglu else fe), fe
        mlp = e * s * b * k * (2 * h + up + f) + 4 * s * b * arch["num_experts"]  # + fp32 router scores
    sharded = e * s * b * (q + kv) + e * s * b * kv + e * s * b * q + mlp
    if swiglu and not fused_swiglu:
        sharded += e * s * b * f
    if flash_attention:
        sharded += 4 * a * s * b  # float32 log-sum-exp per query and head
    elif recompute != "selective":  # softmax output, its dropout mask and output: 5 a s^2 b (2 + 1 + 2)
        sharded += e * a * s * s * b + ((1 + e) * a * s * s * b if attn_dropout else 0)
    return replicated / rep_div + sharded / tp


def estimate(
    arch: dict[str, Any],
    padded_vocab: int,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    micro_batch_size: int = 1,
    num_micro_batches: int | None = None,
    seq_length: int | None = None,
    sequence_parallel: bool | None = None,
    distributed_optimizer: bool = False,
    flash_attention: bool = True,
    recompute: str = "none",
    recompute_method: str = "uniform",
    recompute_num_layers: int = 1,
    virtual_pp: int = 1,
    bf16: bool = True,
    grad_reduce_in_fp32: bool = True,
    fsdp: bool = False,
    ep: int = 1,
) -> MemoryEstimate:
    """Memory per GPU of the fullest pipeline stage (see the module docstring for what is counted).

    ``sequence_parallel`` defaults to ``tp > 1`` (megatron-core's recommendation);
    ``num_micro_batches`` (per step and data-parallel rank) bounds the micro-batches
    in flight on the first pipeline stage. ``recompute``: megatron-core's selective
    (core attention) or full recomputation, the latter ``uniform`` (groups of
    ``recompute_num_layers`` layers keep only their input) or ``block`` (the first
    ``recompute_num_layers`` layers of each chunk keep only their input, the others
    everything). ``virtual_pp``: chunks per pipeline rank (interleaved 1F1B keeps
    ``1 + (pp - 1) / (pp x virtual_pp)`` times the micro-batches of 1F1B in flight).
    ``fsdp`` (snakellm.train.fsdp): every rank keeps ``1 / dp`` of the fp32 parameters (the masters), their
    fp32 gradients and Adam moments (16 bytes a parameter over dp), plus the 16-bit copies of the units
    gathered at a time: two layers (the one running and the next, prefetched) and the output layer,
    and one unit's 16-bit gradients with their copy for the reduce-scatter (fp32 unless ``grad_reduce_in_fp32``
    is off: parallel.grad_reduce_dtype bf16, which also makes megatron-core DDP's gradient buffers bf16).
    ``ep``: a mixture of experts' experts split over that many expert-parallel ranks (each GPU holds
    ``num_experts / ep`` of them: their weights, gradients and optimizer states).
    """
    L, h = arch["num_layers"], arch["hidden_size"]
    if L % (pp * virtual_pp):
        raise ValueError(
            f"num_layers {L} is not divisible by pipeline parallel size {pp} x virtual pipeline size {virtual_pp}"
        )
    s = seq_length or arch["seq_length"]
    b = micro_batch_size
    sp = (tp > 1) if sequence_parallel is None else (bool(sequence_parallel) and tp > 1)
    e = 2 if bf16 else 4
    sharded, replicated = layer_params(arch, tp, ep)
    norm = 2 * h if arch["normalization"] == "LayerNorm" else h
    stage_layers = L // pp
    layers = stage_layers * (sharded + replicated)
    embedding = padded_vocab * h / tp + (s * h if arch["position_embedding"] == "learned" else 0)
    # the output layer: the final norm, and its own weight unless tied to the embedding on the same GPU
    head = norm + (0 if arch["tie_embeddings"] and pp == 1 else padded_vocab * h / tp)

    def act(layer_kind: str = recompute) -> float:
        return layer_activation_bytes(
            arch,
            b,
            seq_length=s,
            tp=tp,
            sequence_parallel=sp,
            flash_attention=flash_attention,
            recompute=layer_kind,
            bytes_per_element=e,
        )

    in_flight: float = pp if num_micro_batches is None else max(1, min(pp, num_micro_batches))
    if virtual_pp > 1:
        in_flight *= 1 + (pp - 1) / (pp * virtual_pp)
    stage_act, recompute_one = _stage_activations(
        act, recompute, recompute_method, recompute_num_layers, stage_layers, virtual_pp
    )
    sbh = s * b * h
    emb_act = (e * sbh + (sbh if (arch.get("hidden_dropout") or 0) > 0 else 0)) / (tp if sp else 1)
    # the final norm's input and the logits: 16-bit, plus the float32 copy the loss makes
    head_act = e * sbh / (tp if sp else 1) + (e + 4) * s * b * padded_vocab / tp
    # (parameters, activations) of the first and the last pipeline stage: one GPU when pp == 1
    first = (
        layers + embedding + (head if pp == 1 else 0),
        in_flight * (stage_act + emb_act) + recompute_one + (head_act if pp == 1 else 0),
    )
    last = (layers + head, stage_act + recompute_one + head_act)
    stage = first if pp == 1 else max(first, last, key=lambda st: st[0] * (18 if bf16 else 16) + st[1])
    params, activations = stage

    experts = stage_layers * _expert_params_per_layer(arch, tp, ep)
    weights, grads, optimizer = _state_bytes(
        params, e, sharded + replicated, head, dp, bf16, grad_reduce_in_fp32, distributed_optimizer, fsdp,
        experts=experts, ep=ep,
    )  # fmt: skip
    fields = (weights, grads, optimizer, activations, tp, pp, dp, b, distributed_optimizer, sp, recompute)
    return MemoryEstimate(int(round(params)), *fields, virtual_pp, fsdp, ep)


def _stage_activations(
    act: Any, recompute: str, method: str, num_layers: int, stage_layers: int, virtual_pp: int
) -> tuple[float, float]:
    """One micro-batch's activations over a stage's layers (its chunks together), and what the unit being
    recomputed holds while its backward pass runs (a group of ``num_layers`` layers under uniform)."""
    if recompute != "full":
        return stage_layers * act(recompute), 0.0
    chunk_layers = stage_layers // virtual_pp
    n = min(num_layers, chunk_layers)
    if method == "uniform":  # each group of n layers keeps its input
        per_chunk = -(-chunk_layers // n) * act("full")
    else:  # block: the first n layers keep their input, the rest everything
        per_chunk = n * act("full") + (chunk_layers - n) * act("none")
    return virtual_pp * per_chunk, (n if method == "uniform" else 1) * act("none")


def _state_bytes(
    params: float,
    e: int,
    layer: float,
    head: float,
    dp: int,
    bf16: bool,
    grad_reduce_in_fp32: bool,
    distributed_optimizer: bool,
    fsdp: bool,
    experts: float = 0.0,
    ep: int = 1,
) -> tuple[float, float, float]:
    """Bytes of the weights, gradients and optimizer states of ``params`` parameters (``layer``, ``head``:
    the parameters of one layer and of the output layer, the units FSDP gathers; ``experts``: how many of
    ``params`` are a mixture of experts' experts, which the distributed optimizer shards over the expert
    data-parallel ranks, ``dp / ep``)."""
    if fsdp:
        unit = max(layer, head)  # the largest unit gathered at a time
        gathered = (2 * layer + head) * e if bf16 else 0.0
        reduced = 4 if grad_reduce_in_fp32 or not bf16 else e  # the reduce-scatter's input, in the reduce dtype
        return params * 4 / dp + gathered, params * 4 / dp + unit * (e + reduced), params * 8 / dp
    weights = params * e
    grads = params * (4 if grad_reduce_in_fp32 or not bf16 else 2)
    per = 12 if bf16 else 8  # fp32 master + exp_avg + exp_avg_sq (no master in fp32)
    if not distributed_optimizer:
        return weights, grads, params * per
    return weights, grads, (params - experts) * per / dp + experts * per / max(1, dp // ep)


def _expert_params_per_layer(arch: dict[str, Any], tp: int, ep: int) -> float:
    """The experts' parameters of one MoE layer on one rank (``num_experts / ep`` experts, each split over tp)."""
    if not arch.get("num_experts"):
        return 0.0
    from snakellm.models.moe import expert_params

    return arch["num_experts"] // ep * expert_params(arch) / tp


def report(
    arch: dict[str, Any],
    padded_vocab: int,
    *,
    tp: int,
    pp: int,
    dp: int,
    micro_batch_size: int,
    num_micro_batches: int | None,
    sequence_parallel: bool,
    distributed_optimizer: bool,
    bf16: bool = True,
    gpu_gib: float | None = None,
    recompute: str = "none",
    recompute_method: str = "uniform",
    recompute_num_layers: int = 1,
    virtual_pp: int = 1,
    fsdp: bool = False,
    grad_reduce_in_fp32: bool = True,
    ep: int = 1,
) -> list[str]:
    """The memory table of a run as configured, and what the options it leaves off would save.

    ``snakellm plan`` and ``snakellm train --dry-run`` both print this: one estimate, one wording.
    """

    def est(sp: bool, dist_opt: bool, rc: str = recompute, sharded: bool = fsdp) -> MemoryEstimate:
        return estimate(
            arch,
            padded_vocab,
            tp=tp,
            pp=pp,
            dp=dp,
            micro_batch_size=micro_batch_size,
            num_micro_batches=num_micro_batches,
            sequence_parallel=sp,
            distributed_optimizer=dist_opt,
            bf16=bf16,
            recompute=rc,
            recompute_method=recompute_method,
            recompute_num_layers=recompute_num_layers,
            virtual_pp=virtual_pp,
            fsdp=sharded,
            grad_reduce_in_fp32=grad_reduce_in_fp32,
            ep=ep,
        )

    out = est(sequence_parallel, distributed_optimizer).lines(gpu_gib)
    # activations under each recomputation setting the run does not use (the others as configured)
    other = [
        f"{rc}{f' ({recompute_method}, {recompute_num_layers} layers)' if rc == 'full' else ''} "
        f"{est(sequence_parallel, distributed_optimizer, rc).activations / GiB:.2f} GiB"
        for rc in RECOMPUTE
        if rc != recompute
    ]
    out.append(f"  (activations with parallel.recompute {', '.join(other)})")
    more_sp = tp > 1 and not sequence_parallel
    # (expert parallelism is not composed with FSDP yet: parallel_conflict refuses the pair)
    more_do = dp > 1 and not distributed_optimizer and not fsdp
    if dp > 1 and not fsdp and ep == 1:
        sharded = est(sequence_parallel, False, sharded=True)
        out.append(
            f"  (parallel.fsdp: true would make it {sharded.total / GiB:.2f} GiB: weights, gradients and optimizer "
            f"{sharded.model_states / GiB:.2f} GiB)"
        )
    if more_sp or more_do:
        alt = est(sequence_parallel or more_sp, distributed_optimizer or more_do)
        keys = [k for k, off in (("sequence_parallel", more_sp), ("distributed_optimizer", more_do)) if off]
        out.append(
            f"  (parallel.{' and parallel.'.join(k + ': true' for k in keys)} would make it {alt.total / GiB:.2f} GiB: "
            f"optimizer {alt.optimizer / GiB:.2f} GiB, activations {alt.activations / GiB:.2f} GiB)"
        )
    return out


# ---------------------------------------------------------------------------------------------- fine-tuning

LORA_TARGET_DIMS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def lora_params(arch: dict[str, Any], rank: int, targets: tuple[str, ...] | list[str], tp: int = 1) -> float:
    """LoRA adapter parameters on one tensor-parallel rank: ``rank x (in + out)`` per targeted linear and layer."""
    h, f = arch["hidden_size"], arch["ffn_hidden_size"]
    d = head_dim(arch)
    qkv = d * (arch["num_attention_heads"] + 2 * arch["num_query_groups"])
    up = 2 * f if arch["activation"] == "swiglu" else f
    dims = {
        "linear_qkv": (h, qkv),
        "linear_proj": (d * arch["num_attention_heads"], h),
        "linear_fc1": (h, up),
        "linear_fc2": (f, h),
    }
    per_layer = sum(rank * sum(dims[t]) for t in targets if t in dims)
    return arch["num_layers"] * per_layer / tp


def finetune_estimate(
    arch: dict[str, Any],
    padded_vocab: int,
    method: str,
    *,
    tp: int,
    dp: int,
    micro_batch_size: int,
    seq_length: int,
    lora_rank: int = 32,
    lora_targets: tuple[str, ...] | list[str] = ("linear_qkv",),
    bf16: bool = True,
    recompute: str = "none",
    fsdp: bool = False,
) -> MemoryEstimate:
    """Memory per GPU of `snakellm finetune` (no pipeline parallelism, no distributed optimizer).

    ``full`` is pretraining's accounting (``fsdp``: sharded as there); ``lora`` and ``ptuning`` freeze the base: its weights are held
    (16-bit) but have no gradient buffer, master weights or Adam states (tests/test_lora.py checks that
    of the real optimizer); those exist for the adapters only. Activations are counted as for full
    training (a frozen linear need not keep its input, but the adapters and the backward pass through the
    base keep most of them). At 8B, compiled LoRA on all four linears (4 H200s) peaked 2.7-3.3% above this
    estimate (tp 1 and 4, micro batch 1-8), inside the headroom of :func:`fits`.
    """
    import dataclasses

    est = estimate(
        arch,
        padded_vocab,
        tp=tp,
        dp=dp,
        micro_batch_size=micro_batch_size,
        seq_length=seq_length,
        sequence_parallel=False,
        bf16=bf16,
        recompute=recompute,
        fsdp=fsdp and method == "full",
    )
    if method == "full":
        return est
    trainable = lora_params(arch, lora_rank, lora_targets, tp) if method == "lora" else 0.0
    e = 2 if bf16 else 4
    return dataclasses.replace(
        est,
        params=int(est.params + trainable),
        weights=est.params * e + trainable * e,
        grads=trainable * 4,
        optimizer=trainable * (12 if bf16 else 8),
    )


def fits(est: MemoryEstimate, gpu_gib: float) -> bool:
    """The verdict of :meth:`MemoryEstimate.lines`: within 90% of the GPU, less 2 GiB for the context."""
    return est.total / GiB <= 0.9 * gpu_gib - 2


def advise_finetune(
    arch: dict[str, Any],
    padded_vocab: int,
    method: str,
    *,
    ranks: int,
    global_batch_size: int,
    seq_length: int,
    gpu_gib: float,
    lora_rank: int = 32,
    lora_targets: tuple[str, ...] | list[str] = ("linear_qkv",),
    layouts: list[tuple[int, bool]] | None = None,
) -> tuple[int, int, str, bool, MemoryEstimate] | None:
    """(tp, micro batch, recompute, fsdp, estimate) that fits ``gpu_gib`` on ``ranks`` GPUs: no recomputation
    before selective before full (the least extra compute), then for a full fine-tune on several GPUs FSDP at
    tp 1 (51-55% MFU at 8B on 4 GPUs against 15-39% at tp 4), then the smallest tensor-parallel size (the least
    communication), then the largest micro batch up to 8 that divides the batch; None if none fits.
    ``layouts``: only these (tp, fsdp) pairs (the configured one: its largest micro batch that fits)."""
    heads, groups = arch["num_attention_heads"], arch["num_query_groups"]
    tps = [t for t in (1, 2, 4, 8) if ranks % t == 0 and heads % t == 0 and groups % t == 0]
    if layouts is None:
        layouts = ([(1, True)] if method == "full" and ranks > 1 else []) + [(t, False) for t in tps]
    for recompute in RECOMPUTE:
        for tp, fsdp in layouts:
            dp = ranks // tp
            best = None
            for mbs in (1, 2, 4, 8):
                if global_batch_size % (mbs * dp):
                    continue
                est = finetune_estimate(
                    arch,
                    padded_vocab,
                    method,
                    tp=tp,
                    dp=dp,
                    micro_batch_size=mbs,
                    seq_length=seq_length,
                    lora_rank=lora_rank,
                    lora_targets=lora_targets,
                    recompute=recompute,
                    fsdp=fsdp,
                )
                if fits(est, gpu_gib):
                    best = (tp, mbs, recompute, fsdp, est)
            if best:
                return best
    return None
