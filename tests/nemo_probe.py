"""Run inside the NeMo venv (scripts/setup-nemo-env.sh), never in snakellm's: NeMo 2.4.1's own loader.

    python tests/nemo_probe.py IN.nemo BATCH.pt OUT_DIR [--resave OUT.nemo --seed N]
    python tests/nemo_probe.py --jobs JOBS.json   (several files in one process: NeMo's import is ~25 s)

Restores IN.nemo with ``MegatronGPTModel.restore_from`` (NeMo's NLPSaveRestoreConnector,
DistributedCheckpointIO, tokenizer artifacts) on CPU and writes to OUT_DIR:
``state.pt`` (every tensor of the megatron-core model NeMo built), ``logits.pt`` (its
forward pass on the token batch in BATCH.pt), ``config.json`` (NeMo's resolved cfg) and
``tokenizer.json`` (what NeMo's tokenizer makes of a probe text). With ``--resave`` it then
adds seeded noise to every weight (so the file is NeMo's, not a copy of ours), dumps
``resaved_state.pt``/``resaved_logits.pt`` and writes OUT.nemo with NeMo's ``save_to``.

Only environment shims, none of which touches how a ``.nemo`` is read (why each is needed:
there is no GPU, apex or Transformer Engine here, and NeMo 2.4.1 predates megatron-core 0.16):

(a) ``nlp_overrides.HAVE_APEX = True``: NLPDDPStrategy.__init__ refuses to start without apex,
    which it does not use for loading.
(b) env ``NVIDIA_PYTORCH_VERSION=24.07``: MegatronBaseModel._enable_nvidia_optimizations runs
    ``re.fullmatch`` on it and crashes on None outside NGC containers.
(c) ``parallel_state.set_pipeline_model_parallel_split_rank`` stub: removed in megatron-core 0.16;
    NeMo's megatron_init imports it and otherwise silently sets HAVE_MEGATRON_CORE = False.
(d) a single-process gloo group + ``initialize_model_parallel(1, 1)`` before NeMo builds the model:
    megatron-core 0.16's GPTModel needs process groups at construction; NeMo creates them only in
    Lightning's (GPU) launcher; plus megatron-core's inference RNG tracker (the CUDA one needs a GPU).
(e) ``megatron_gpt_model.get_specs`` returns megatron-core's local layer spec: NeMo builds the TE spec
    eagerly (even when unused) and ``transformer_engine: true`` asks for it; without TE it cannot be
    built. The local spec has the same dist-checkpoint keys (megatron-core's sharded_state_dict_keys_map).
(f) ``build_model.set_defaults_if_not_set_tensor_model_parallel_attributes`` from megatron-core: NeMo
    imports it from apex.
(g) an empty module ``megatron.core.dist_checkpointing.strategies.tensorstore``: NeMo's dist_ckpt_io
    imports it at module level; megatron-core 0.16 removed it (we write torch_dist, never zarr).
(i) no network: HF_HUB_OFFLINE=1 and, in the working directory, ``gpt2/config.json`` = {"model_type": "gpt2"}
    and ``gpt2/tokenizer_config.json`` = {"model_max_length": 1024} (both as on the hub).
    For ``library: megatron, type: GPT2BPETokenizer`` NeMo calls ``AutoTokenizer.from_pretrained("gpt2",
    vocab_file=<from the .nemo>, merges_file=<from the .nemo>)``, which asks the hub only which tokenizer class
    "gpt2" is; the directory holds no tokenizer files, so the vocabulary and merges NeMo uses are the .nemo's.
(h) ``torch.cuda.current_device``/``synchronize`` for a CPU-only torch (megatron-core's writer calls them),
    and the config override ``use_cpu_initialization: true`` (False calls torch.cuda.set_device).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

os.environ.setdefault("NVIDIA_PYTORCH_VERSION", "24.07")  # (b)
os.environ["HF_HUB_OFFLINE"] = "1"  # (i)

import torch

torch.cuda.current_device = lambda: torch.device("cpu")  # (h)
torch.cuda.synchronize = lambda *a, **k: None  # (h)

import megatron.core.parallel_state as ps  # noqa: E402

if not hasattr(ps, "set_pipeline_model_parallel_split_rank"):  # (c)
    ps.set_pipeline_model_parallel_split_rank = lambda *a, **k: None
_ts = types.ModuleType("megatron.core.dist_checkpointing.strategies.tensorstore")  # (g)
sys.modules.setdefault(_ts.__name__, _ts)


def _shims() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import set_defaults_if_not_set_tensor_model_parallel_attributes
    from nemo.collections.nlp.models.language_modeling import megatron_gpt_model
    from nemo.collections.nlp.modules.common.megatron import build_model
    from nemo.collections.nlp.parts import nlp_overrides

    nlp_overrides.HAVE_APEX = True  # (a)
    build_model.set_defaults_if_not_set_tensor_model_parallel_attributes = (  # (f)
        set_defaults_if_not_set_tensor_model_parallel_attributes
    )

    def local_specs(spec_name, transformer_config=None, use_te=True, hyena_cfg=None, fp8=False):  # (e)
        if spec_name not in ("", "te_gpt"):
            raise ValueError(f"probe: spec {spec_name!r} is not available without Transformer Engine")
        num_experts = transformer_config.num_moe_experts if transformer_config else None
        return get_gpt_layer_local_spec(num_experts, False)

    megatron_gpt_model.get_specs = local_specs

    torch.distributed.init_process_group("gloo", rank=0, world_size=1, store=torch.distributed.HashStore())  # (d)
    ps.initialize_model_parallel(1, 1)
    from megatron.core import tensor_parallel

    # megatron-core's CPU-friendly RNG tracker (model_parallel_cuda_manual_seed needs CUDA)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone()
        for k, v in module.state_dict().items()
        if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
    }


def _logits(module: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(tokens.size(1)).unsqueeze(0).expand_as(tokens)
    # the causal mask spelled out: megatron-core's default one is created on "cuda"
    mask = torch.triu(torch.ones(tokens.size(1), tokens.size(1), dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        return module(input_ids=tokens, position_ids=pos, attention_mask=mask).float()


def probe(trainer, nemo: str, batch: str, out_dir: str, resave: str | None = None, seed: int = 0) -> None:
    """One file: restore_from, its tensors, logits, config and tokenizer into out_dir (then save_to with --resave)."""
    from nemo.collections.nlp.models.language_modeling.megatron_gpt_model import MegatronGPTModel
    from nemo.collections.nlp.parts.nlp_overrides import NLPSaveRestoreConnector
    from omegaconf import OmegaConf

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    nemo, batch = str(Path(nemo).resolve()), str(Path(batch).resolve())
    resave = str(Path(resave).resolve()) if resave else None
    (out / "gpt2").mkdir(exist_ok=True)  # (i)
    (out / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (out / "gpt2" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    here = os.getcwd()
    os.chdir(out)
    try:
        cfg = MegatronGPTModel.restore_from(
            nemo, trainer=trainer, return_config=True, save_restore_connector=NLPSaveRestoreConnector()
        )
        OmegaConf.set_struct(cfg, False)
        cfg.use_cpu_initialization = True  # (h)
        model = MegatronGPTModel.restore_from(
            nemo, trainer=trainer, override_config_path=cfg, save_restore_connector=NLPSaveRestoreConnector()
        )
        model.eval()
        gpt = model.model
        tokens = torch.load(batch)
        torch.save(_tensors(gpt), out / "state.pt")
        torch.save(_logits(gpt, tokens), out / "logits.pt")
        (out / "config.json").write_text(json.dumps(OmegaConf.to_container(model.cfg, resolve=True), indent=1))
        text = "Hello world, this is NeMo reading a snakellm file."
        ids = model.tokenizer.text_to_ids(text)
        (out / "tokenizer.json").write_text(
            json.dumps(
                {
                    "class": type(model.tokenizer).__name__,
                    "text": text,
                    "ids": ids,
                    "vocab_size": model.tokenizer.vocab_size,
                    "eos_id": model.tokenizer.eos_id,
                    "padded_vocab_size": model.padded_vocab_size,
                }
            )
        )
        if resave:
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for prm in gpt.parameters():
                    prm.add_(torch.randn(prm.shape, generator=g, dtype=prm.dtype) * 0.01)
            torch.save(_tensors(gpt), out / "resaved_state.pt")
            torch.save(_logits(gpt, tokens), out / "resaved_logits.pt")
            model.save_to(resave)
    finally:
        os.chdir(here)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("nemo", nargs="?")
    p.add_argument("batch", nargs="?")
    p.add_argument("out", nargs="?")
    p.add_argument("--resave")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--jobs", help="a JSON list of {nemo, batch, out_dir[, resave, seed]}: several files, one NeMo import"
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    _shims()
    from lightning.pytorch import Trainer
    from nemo.collections.nlp.parts.nlp_overrides import NLPDDPStrategy

    if a.jobs:
        jobs = json.loads(Path(a.jobs).read_text())
    else:
        jobs = [dict(nemo=a.nemo, batch=a.batch, out_dir=a.out, resave=a.resave, seed=a.seed)]
    for job in jobs:
        trainer = Trainer(
            strategy=NLPDDPStrategy(), accelerator="cpu", devices=1, logger=False, enable_checkpointing=False
        )
        probe(trainer, **job)
        print(f"probe: ok: {job['nemo']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
