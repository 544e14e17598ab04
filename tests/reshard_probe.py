"""Load a checkpoint through `snakellm train`'s own resume path and compare every tensor with the bytes written.

Run as ``python reshard_probe.py ITERATION <snakellm train arguments>`` (or under torchrun) in the run's
working directory: it opens the job's session at the layout the arguments ask for, builds the model, DDP
and optimizer as training does, restores ``iter_ITERATION`` with the checkpoint manager training uses, and
compares each loaded model weight and optimizer state (this rank's slice of it) with the whole tensor
read back from the checkpoint's files by torch.distributed.checkpoint (an independent reader). Prints one
JSON line per rank: the tensors compared and those that differ.
"""

from __future__ import annotations

import json
import sys
import tempfile


def main() -> None:
    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from snakellm.io import checkpoint as ckpt
    from snakellm.steps.train import build_parser
    from snakellm.train import assembly
    from snakellm.train.pretrain import PretrainRecipe, job_of
    from snakellm.train.request import make_request

    it = int(sys.argv[1])
    req = make_request(build_parser().parse_args(sys.argv[2:]))
    job, recipe = job_of(req), PretrainRecipe(req)
    s = assembly.open_session(job)
    try:
        parts = recipe.build(s)
        _, opt, sched = assembly._wrap(job, s, parts)
        holder: dict = {"skip_rng": True}
        manager = assembly._manager(job, s, parts, opt, sched, "probe", recipe, holder)
        loaded, _ = manager.restore(it)
        parts.load_state(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(str(job.ckpt_dir / ckpt.iter_name(it)), f"{tmp}/full.pt")
            written = torch.load(f"{tmp}/full.pt", weights_only=False)
        # the sharded state after loading: its tensors are this rank's model parameters and optimizer states
        tensors, _ = extract_sharded_tensors_and_factories(manager.sharded_state(False))
        shards = []
        for t in nested_values(tensors):
            shards += (
                [x for x in nested_values(t.build()) if isinstance(x, ShardedTensor)]
                if isinstance(t, ShardedTensorFactory)
                else [t]
            )
        compared, differ = 0, []
        for t in shards:
            full = written[t.key]
            lead = t.prepend_axis_num
            index = tuple(t.global_offset[:lead]) + tuple(
                slice(o, o + n) for o, n in zip(t.global_offset[lead:], t.local_shape)
            )
            compared += 1
            if not torch.equal(full[index].to(t.data.dtype), t.data.detach().cpu()):
                differ.append(t.key)
        print(json.dumps({"rank": s.dist.rank, "compared": compared, "differ": differ}), flush=True)
    finally:
        assembly.runtime.shutdown()


if __name__ == "__main__":
    main()
