"""Starting torch.distributed and megatron-core's parallel state, on CPU or GPU.

Everything that runs a megatron-core model (training, fine-tuning, export,
generation, serving) starts the same way: a process group (gloo on the CPU,
NCCL on GPUs), megatron-core's model-parallel groups, its RNG tracker, and on a
machine without CUDA two small shims (megatron-core asks ``torch.cuda`` for the
current device in places that also work on the CPU).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

from snakellm.launch.distributed import DistEnv, LaunchError

__all__ = ["LaunchError"]  # the one LaunchError (snakellm.launch.distributed), raised here too


def install_cpu_shims(torch: Any) -> None:
    """megatron-core asks torch.cuda for the current device in places that also work on the CPU."""
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None


class _CpuTorch:
    """``torch`` as megatron-core's pipeline schedules see it on the CPU: ``torch.zeros(..., device="cuda")``
    (their token counter, the one place the schedules allocate on a named device) lands on the CPU."""

    def __init__(self, torch: Any):
        self._torch = torch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def zeros(self, *args: Any, device: Any = None, **kw: Any) -> Any:
        return self._torch.zeros(*args, device="cpu" if device == "cuda" else device, **kw)


def install_cpu_megatron_shims() -> None:
    """The two places megatron-core's schedules and activation recomputation need CUDA, for gloo on the CPU.

    * the pipeline schedules (``get_forward_backward_func``: 1F1B, interleaved, no pipelining) count
      tokens in ``torch.zeros([], device="cuda")``: their module sees :class:`_CpuTorch`;
    * activation recomputation (``tensor_parallel.checkpoint``) saves and restores the CUDA generator's
      state beside the CPU one: on the CPU there is none, so that part is a no-op (the CPU generator
      and megatron's (inference) RNG tracker are still saved and restored);
    * the MoE layer's alltoall dispatcher (:func:`_moe_cpu_shim`).
    The same schedules and recomputation run unchanged on GPUs.
    """
    import torch
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom

    if not isinstance(schedules.torch, _CpuTorch):
        schedules.torch = _CpuTorch(torch)
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    _moe_cpu_shim()


def _moe_cpu_shim() -> None:
    """Where megatron-core 0.16.1's MoE layer needs CUDA, for the CPU (gloo); its Transformer Engine name is
    :func:`no_te_router_gemm`'s, which :func:`pick_device` sets on every device.

    The alltoall dispatcher makes a ``torch.cuda.Stream`` for its device-to-host copies of the split
    sizes and synchronises on its event: on the CPU the sizes are host tensors already, so the class's
    stream is a placeholder and the copy point only turns them into the numpy arrays the GPU path makes.
    The GPU path is megatron-core's, unchanged.
    """
    import torch
    from megatron.core.transformer.moe import token_dispatcher as td

    cls = td.MoEAlltoAllTokenDispatcher
    if getattr(cls._maybe_dtoh_and_synchronize, "_snakellm_cpu", False):
        return
    if cls.cuda_dtoh_stream is None:
        cls.cuda_dtoh_stream = object()

    def on_cpu(self: Any, point: str, tokens_per_expert: Any = None) -> Any:
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                v = getattr(self, name)
                if torch.is_tensor(v):
                    setattr(self, name, v.numpy())
        return tokens_per_expert

    on_cpu._snakellm_cpu = True  # type: ignore[attr-defined]
    cls._maybe_dtoh_and_synchronize = on_cpu


@contextlib.contextmanager
def cpu_tensor_cuda(cuda: bool) -> Iterator[None]:
    """While a model is built on the CPU: ``Tensor.cuda()`` returns the tensor (megatron-core moves the
    last pipeline stage's copy of tied embeddings to the GPU before it all-reduces it from the first)."""
    import torch

    if cuda:
        yield
        return
    saved = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = saved  # type: ignore[method-assign]


def prepare(
    torch: Any,
    requested: str,
    tp: int = 1,
    threads: int | None = None,
    *,
    cpu_tp: bool = False,
    dropout: bool = False,
) -> bool:
    """Decide CPU or GPU before anything starts; returns True for CUDA.

    The checks every job shares (training, fine-tuning): ``--device cuda`` needs a GPU, tensor
    parallelism on the CPU only where the caller supports it (``cpu_tp``: pretraining, whose
    tests run TP=2 on gloo against one process) and only without ``dropout`` (megatron-core
    draws the tensor-parallel ranks' dropout masks from its CUDA RNG tracker; the CPU gets its
    inference tracker, one stream for all ranks), ``threads`` sets torch's intra-op threads on
    the CPU. It also silences the library warnings of :mod:`snakellm.quiet` (which ``snakellm <step>``
    has done already; this is for a job started another way).
    """
    from snakellm import quiet

    if requested == "cuda" and not torch.cuda.is_available():
        raise LaunchError("--device cuda: no CUDA device is available")
    cuda = requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
    if not cuda and tp != 1 and not cpu_tp:
        raise LaunchError(f"tensor parallel size {tp} needs GPUs; on the CPU use tp 1")
    if not cuda and tp != 1 and dropout:
        raise LaunchError(
            f"tensor parallel size {tp} with dropout needs GPUs: megatron-core draws the tensor-parallel "
            "ranks' dropout masks from its CUDA RNG tracker; on the CPU use tp 1 or hidden_dropout and "
            "attention_dropout 0"
        )
    if not cuda and threads:
        torch.set_num_threads(threads)
    quiet.install()
    return cuda


def no_te_router_gemm() -> None:
    """megatron-core 0.16.1's ``router_gating_linear`` tests ``te_general_gemm``, a name its module defines only
    when Transformer Engine imports: without TE (CPU or GPU) the name is set to None, its own fallback (a plain
    matmul)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def pick_device(torch: Any, requested: str, local_rank: int = 0) -> Any:
    """``auto``/``cpu``/``cuda`` (or ``cuda:N``) -> a torch.device; one GPU per rank, by local rank."""
    no_te_router_gemm()
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {requested}: no CUDA device is available")
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        install_cpu_shims(torch)
        return torch.device("cpu")
    if ":" in requested:
        device = torch.device(requested)
    else:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def init_process_group(torch: Any, dist: DistEnv, device: Any, timeout_s: float | None = None) -> None:
    """gloo on CPU, NCCL on GPU. A single process gets an in-memory store, so that concurrent
    single-process runs on one machine never meet on a TCP port."""
    cuda = device.type == "cuda"
    store = torch.distributed.HashStore() if dist.world_size == 1 else None
    kwargs: dict[str, Any] = {"device_id": device} if cuda else {}
    if timeout_s:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    torch.distributed.init_process_group(
        backend="nccl" if cuda else "gloo", rank=dist.rank, world_size=dist.world_size, store=store, **kwargs
    )


def init_model_parallel(
    tp: int = 1, pp: int = 1, seed: int | None = None, cuda: bool = False, vpp: int = 1, ep: int = 1
) -> None:
    """megatron-core's parallel groups and its RNG tracker.

    On a GPU the tracker is seeded by ``model_parallel_cuda_manual_seed`` (here if
    ``seed`` is given, else by the caller after seeding the other generators); the
    CPU gets megatron's plain (inference) tracker, since the CUDA one needs a GPU,
    and the shims of :func:`install_cpu_megatron_shims`. ``vpp``: virtual pipeline
    stages (model chunks) per pipeline rank, for the interleaved schedule; ``ep``: expert-parallel
    ranks (megatron-core's expert groups, within the data-parallel ranks of the dense layers).
    """
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(
        tp, pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, expert_model_parallel_size=ep
    )

    if not cuda:  # a CPU job, also on a machine with GPUs (pick_device's shims already point megatron at the CPU)
        install_cpu_megatron_shims()
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    elif seed is not None:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def ensure_single_process(device: str = "cpu", seed: int = 1234) -> Any:
    """For tools that run one process (export, generation, serving): start what is not started yet.

    Returns the torch.device used. A no-op when a process group and megatron-core's
    parallel state already exist (e.g. inside a training job).
    """
    import torch
    from megatron.core import parallel_state

    dev = pick_device(torch, device)
    if not torch.distributed.is_initialized():
        single = DistEnv(
            rank=0,
            world_size=1,
            local_rank=0,
            local_world_size=1,
            master_addr="127.0.0.1",
            master_port=0,
            launcher="single",
        )
        init_process_group(torch, single, dev)
    if not parallel_state.model_parallel_is_initialized():
        init_model_parallel(1, 1, seed=seed, cuda=dev.type == "cuda")
    return dev


def shutdown() -> None:
    """Tear down megatron-core's groups and the process group (safe to call when nothing runs)."""
    import contextlib

    import torch

    with contextlib.suppress(Exception):
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    with contextlib.suppress(Exception):
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
