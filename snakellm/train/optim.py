"""AdamW over megatron-core DDP gradients, with fp32 master weights for bf16 models.

megatron-core's own optimizer wrappers allocate on ``device="cuda"`` and, without
apex or Transformer Engine, run an unfused torch AdamW plus Python-level
multi-tensor fallbacks. This is the same algorithm in a few lines: gradients
come from DDP's contiguous fp32 ``main_grad`` buffers, the clip coefficient is
computed on the device (no host sync per step), torch's fused AdamW updates
fp32 master weights, and bf16 model weights are refreshed with one
``_foreach_copy_``.

The checkpoint layout is Megatron's: for bf16 models that of
``Float16OptimizerWithFloat16Params`` (``optimizer`` + ``fp32_from_fp16_params``),
for fp32 models that of ``FP32Optimizer``, with every per-parameter tensor a
``ShardedTensor`` keyed after its model parameter (``optimizer.state.exp_avg.<key>``),
so tensor-parallel resharding works as for the model.
"""

from __future__ import annotations

import torch


def _is_tp_duplicate(p) -> bool:
    """True for a replicated parameter on a tensor-parallel rank other than 0 (counted once in the norm)."""
    from megatron.core import parallel_state

    if getattr(p, "tensor_model_parallel", False):
        return False
    return parallel_state.get_tensor_model_parallel_rank() != 0


class MixedPrecisionAdamW:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        clip_grad: float,
        fused: bool | None = None,
    ):
        self.clip_grad = clip_grad
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for _name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            # no weight decay on biases and norm gains (1-D), as in Megatron-LM and GPT-2
            (no_decay if p.dim() < 2 else decay).append(p)
        self.model_groups = [g for g in (decay, no_decay) if g]
        self.master_groups = [
            [p if p.dtype == torch.float32 else p.detach().clone().float() for p in g] for g in self.model_groups
        ]
        self.has_masters = any(
            m is not p for mg, pg in zip(self.master_groups, self.model_groups) for m, p in zip(mg, pg)
        )
        wds = [weight_decay, 0.0] if (decay and no_decay) else ([weight_decay] if decay else [0.0])
        device = next(model.parameters()).device
        if fused is None:
            fused = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(
            [{"params": g, "weight_decay": wd} for g, wd in zip(self.master_groups, wds)],
            lr=lr,
            betas=betas,
            eps=eps,
            fused=fused or None,
            foreach=None if fused else True,
        )
        self._pairs = [(p, m) for pg, mg in zip(self.model_groups, self.master_groups) for p, m in zip(pg, mg)]
        self._norm_mask = [not _is_tp_duplicate(p) for p, _ in self._pairs]

    # ------------------------------------------------------------------ step

    def step(self, lr: float) -> torch.Tensor:
        """Clip and apply the accumulated ``main_grad``s; return the gradient norm (on the device)."""
        from megatron.core import parallel_state

        grads = []
        for p, m in self._pairs:
            g = p.main_grad  # type: ignore[attr-defined]  # set by megatron-core DDP
            m.grad = g if g.dtype == torch.float32 else g.float()
            grads.append(m.grad)
        norm_grads = [g for g, keep in zip(grads, self._norm_mask) if keep]
        sq = torch.stack(torch._foreach_norm(norm_grads)).square().sum() if norm_grads else grads[0].new_zeros(())
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(sq, group=parallel_state.get_tensor_model_parallel_group())
        norm = sq.sqrt()
        if self.clip_grad > 0:
            coef = torch.clamp(self.clip_grad / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.has_masters:
            models = [p.data for p, m in self._pairs if m is not p]
            masters = [m.data for p, m in self._pairs if m is not p]
            torch._foreach_copy_(models, masters)
        for _, m in self._pairs:
            m.grad = None
        return norm

    # ------------------------------------------------------------------ checkpoints

    def _init_state(self):
        """Allocate the (lazily created) AdamW state so there is something to load into."""
        fused = bool(self.optimizer.defaults.get("fused"))
        for _, m in self._pairs:
            st = self.optimizer.state[m]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=m.device if fused else "cpu")
                st["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False) -> dict:
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
            optim_state_to_sharding_state,
        )

        if is_loading:
            self._init_state()
        inner = self.optimizer.state_dict()
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, [p for p, _ in self._pairs])
        step = None
        for st in inner["state"].values():
            step = st.get("step", step)
        optim_state_to_sharding_state(inner, id_map, exclude_keys=("step",))
        if step is not None:
            inner["state"]["common_step"] = step
        if not self.has_masters:
            return inner
        fp32 = []
        idx = 0
        for mg in self.master_groups:
            row = []
            for m in mg:
                row.append(make_sharded_optimizer_tensor(id_map[idx], m, prefix="optimizer.state.fp32_param"))
                idx += 1
            fp32.append(row)
        return {"optimizer": inner, "fp32_from_fp16_params": fp32}

    def load_state_dict(self, state: dict) -> None:
        inner = state["optimizer"] if self.has_masters else state
        step = inner["state"].pop("common_step", None)
        if step is not None:
            for st in inner["state"].values():
                st["step"] = step.clone() if torch.is_tensor(step) else step
        self.optimizer.load_state_dict(inner)
        if self.has_masters:
            with torch.no_grad():
                for mg, loaded in zip(self.master_groups, state["fp32_from_fp16_params"]):
                    for m, t in zip(mg, loaded):
                        m.copy_(t)
                for p, m in self._pairs:
                    if m is not p:
                        p.data.copy_(m)
