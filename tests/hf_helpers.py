"""Shared by the Hugging Face, generation and server tests: random models saved as snakellm checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPT2_DIR = REPO / "resources" / "tokenizers" / "gpt2"


def botchan_texts(n: int = 200) -> list[str]:
    texts = []
    for f in sorted((REPO / "resources" / "corpus" / "botchan").glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                texts.append(json.loads(line)["text"])
    return texts[:n]


def train_spm(tmp: Path, vocab_size: int = 600, model_type: str = "bpe") -> Path:
    import sentencepiece as spm

    text = tmp / "botchan.txt"
    text.write_text("\n".join(botchan_texts(2000)), encoding="utf-8")
    prefix = tmp / f"spm-{model_type}"
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        minloglevel=2,
        num_threads=1,
    )
    return prefix.with_suffix(".model")


def save_random_hf(config, src: Path, spm: Path, tokenizer_config: dict):
    """A transformers model of ``config`` (seeded; norms and biases perturbed away from their constant
    initialisation) saved with ``save_pretrained``, the SentencePiece model and ``tokenizer_config``."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(src)
    shutil.copy(spm, src / "tokenizer.model")
    (src / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return hf


def tokenizer_block(kind: str, path: Path | None = None) -> dict:
    """A blend.json-style tokenizer block (what the checkpoint records)."""
    from snakellm.tokenize import encoders

    if kind == "gpt2-bpe":
        t = encoders.load(
            "gpt2-bpe", name="gpt2", vocab_file=str(GPT2_DIR / "vocab.json"), merges_file=str(GPT2_DIR / "merges.txt")
        )
    else:
        t = encoders.load("sentencepiece", name="spm", model_file=str(path))
    return t.info()


def random_checkpoint(run_dir: Path, arch_overrides: dict, tok: dict, seed: int = 0, preset: str = "tiny"):
    """A randomly initialised model saved as runs/NAME/checkpoints/iter_0000000; returns (model, arch, padded)."""
    import torch

    from snakellm.export.hf import build_for_import
    from snakellm.models.architecture import padded_vocab_size, resolve
    from snakellm.models.loading import save_model_checkpoint

    arch = resolve(preset, arch_overrides)
    padded = padded_vocab_size(tok["vocab_size"], arch)
    torch.manual_seed(seed)
    model = build_for_import(arch, padded)
    with torch.no_grad():  # make norms and biases non-trivial so that a wrong mapping shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    save_model_checkpoint(run_dir, model, arch, padded, tok, 0)
    return model, arch, padded
