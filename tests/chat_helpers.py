"""A real Hugging Face tokenizer directory with chat control tokens, for chat-template tests.

GPT-2's byte-level BPE (resources/tokenizers/gpt2) as a ``tokenizer.json`` with ChatML's,
Llama 3's and Mistral's control tokens added as special tokens, and a ``tokenizer_config.json``
naming BOS/EOS and holding the chat template: what ``transformers.AutoTokenizer`` loads.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT2 = ROOT / "resources" / "tokenizers" / "gpt2"
CONTROL = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<s>", "</s>", "[INST]", "[/INST]"]  # fmt: skip
SPECIALS = {
    "chatml": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "mistral": {"bos_token": "<s>", "eos_token": "</s>"},
}


def trl_template(name: str) -> str:
    """A chat template as TRL ships it (real model templates, some with a ``_training`` marker variant)."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")


def chat_tokenizer_dir(dest: Path, template: str | None, family: str = "chatml") -> Path:
    """Write tokenizer.json + tokenizer_config.json (+ the template) into ``dest``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    dest.mkdir(parents=True, exist_ok=True)
    bpe = models.BPE.from_file(str(GPT2 / "vocab.json"), str(GPT2 / "merges.txt"))
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL])
    tok.save(str(dest / "tokenizer.json"))
    cfg: dict = {"tokenizer_class": "PreTrainedTokenizerFast", **SPECIALS[family]}
    if template is not None:
        cfg["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    return dest
