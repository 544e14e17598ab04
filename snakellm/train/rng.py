"""Every random number generator a resumed run must continue exactly (python, numpy, torch, CUDA, megatron)."""

from __future__ import annotations

import random
from typing import Any


def rng_states(cuda: bool) -> dict[str, Any]:
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    st = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if cuda:
        st["cuda_rng_state"] = torch.cuda.get_rng_state()
    return st


def set_rng_states(st: dict[str, Any], cuda: bool) -> None:
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    random.setstate(st["random_rng_state"])
    np.random.set_state(st["np_rng_state"])
    torch.set_rng_state(st["torch_rng_state"])
    if cuda and "cuda_rng_state" in st:
        torch.cuda.set_rng_state(st["cuda_rng_state"])
    if st.get("rng_tracker_states"):
        tensor_parallel.get_cuda_rng_tracker().set_states(st["rng_tracker_states"])


def seed_all(seed: int) -> None:
    """python, numpy and torch generators (megatron's tracker is seeded by launch.runtime.init_model_parallel)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
