"""Subprocess helpers for tests/test_nemo_compat.py (snakellm's venv; one process each, like a real job).

python tests/nemo_helpers.py make RUN_DIR ARCH.json TOKENIZER.json SEED
    a model-only checkpoint of the given architecture with seeded random weights
    (norms and biases included, so no tensor is trivially 0 or 1)
python tests/nemo_helpers.py dump RUN_DIR BATCH.pt OUT_DIR
    our model loaded from RUN_DIR's checkpoint: OUT_DIR/state.pt (every tensor) and logits.pt
python tests/nemo_helpers.py steps STEPS.json
    a JSON list of [cwd, command, *args], run in order in this one process: command is make, dump or
    snakellm (``snakellm.cli.main(args)``, the command line's own entry point): one torch and megatron-core
    import (~10 s here) for every style's steps rather than one a step
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from snakellm.export import nemo
from snakellm.models import architecture, load, save_model_checkpoint


def make(run_dir: str, arch_json: str, tok_json: str, seed: str) -> None:
    arch = architecture.resolve(None, json.loads(Path(arch_json).read_text()))
    tok = json.loads(Path(tok_json).read_text())
    vocab = architecture.padded_vocab_size(tok["vocab_size"], arch)
    with nemo.model_parallel():
        torch.manual_seed(int(seed))
        module = nemo.build(arch, vocab)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if "layer_norm" in name or "layernorm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif name.endswith("bias"):
                    p.copy_(0.02 * torch.randn_like(p))
        save_model_checkpoint(Path(run_dir), module, arch, vocab, tok)


def dump(run_dir: str, batch: str, out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with nemo.model_parallel():
        m = load(run_dir)
        module = m.model
        info = {"iteration": m.iteration, "arch": m.arch, "tokenizer": m.tokenizer}
        tokens = torch.load(batch)
        pos = torch.arange(tokens.size(1)).unsqueeze(0).expand_as(tokens)
        with torch.no_grad():
            logits = module(input_ids=tokens, position_ids=pos, attention_mask=None).float()
        state = {
            k: v.detach().clone()
            for k, v in module.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
        }
    torch.save(state, out / "state.pt")
    torch.save(logits, out / "logits.pt")
    (out / "info.json").write_text(json.dumps(info))


def steps(steps_json: str) -> None:
    import os

    from snakellm import cli

    here = os.getcwd()
    for cwd, cmd, *args in json.loads(Path(steps_json).read_text()):
        os.chdir(cwd)
        try:
            if cmd == "snakellm":
                rc = cli.main(args)
                if rc:
                    raise SystemExit(f"snakellm {' '.join(args)} (in {cwd}): exit {rc}")
            else:
                COMMANDS[cmd](*args)
        finally:
            os.chdir(here)


COMMANDS = {"make": make, "dump": dump, "steps": steps}

if __name__ == "__main__":
    torch.set_num_threads(1)
    cmd, *args = sys.argv[1:]
    COMMANDS[cmd](*args)
