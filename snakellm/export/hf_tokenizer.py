"""Tokenizer files that ``transformers.AutoTokenizer`` loads and that give our ids.

Built with the ``tokenizers`` library directly (its file format is stable across
transformers 4.x and 5.x, unlike transformers' own slow->fast converters):

``gpt2-bpe``
    ``vocab.json`` + ``merges.txt`` + a byte-level BPE ``tokenizer.json``, class
    ``GPT2Tokenizer``.
``sentencepiece``
    ``tokenizer.model`` (for NeMo/Llama tooling) + a ``tokenizer.json`` that
    reproduces sentencepiece itself: the model's precompiled normalisation
    (``nmt_nfkc`` by default), whitespace stripping/collapsing, the dummy
    prefix, BPE merges recovered from the piece scores (or the Unigram
    lattice), byte fallback. Class ``PreTrainedTokenizerFast``: transformers'
    ``LlamaTokenizer`` rebuilds its own pipeline with no normaliser, which
    gives other ids for text that NFKC or whitespace collapsing would change.
``huggingface``
    the ``tokenizer.json`` as is.

No BOS is added (``add_bos_token: false``): our models were trained on
EOD-separated documents without one. Difference that remains: HF matches special
tokens (``<|endoftext|>``, ``</s>``) written literally in the text, while our
encoders (like Megatron's) encode such text as ordinary characters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from snakellm.errors import StepFailed
from snakellm.io.atomic import write_json


class TokenizerExportError(StepFailed, ValueError):
    pass


def _resolve(path: str, base: Path | None) -> Path:
    p = Path(path)
    if not p.is_absolute() and base is not None and not p.exists():
        p = base / p
    if not p.is_file():
        raise TokenizerExportError(f"{path}: tokenizer file not found")
    return p


def sentencepiece_tokenizer_json(model_file: str | Path):
    """A ``tokenizers.Tokenizer`` equal to sentencepiece on ``model_file`` (ids and pieces)."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE, Unigram

    proto = pb.ModelProto()  # type: ignore[attr-defined]
    proto.ParseFromString(Path(model_file).read_bytes())
    ts, ns = proto.trainer_spec, proto.normalizer_spec
    pieces = [(p.piece, p.score) for p in proto.pieces]
    if ts.model_type == 1:  # unigram
        tok = Tokenizer(Unigram(pieces, unk_id=ts.unk_id, byte_fallback=ts.byte_fallback))
    elif ts.model_type == 2:  # bpe: a merge's priority is the score of the piece it makes
        vocab = {p: i for i, (p, _) in enumerate(pieces)}
        merges: list[tuple[str, str, float]] = []
        for piece, score in pieces:
            local = [
                (piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab
            ]
            merges += sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]]))
        ordered = [(a, b) for a, b, _ in sorted(merges, key=lambda x: x[2], reverse=True)]
        tok = Tokenizer(BPE(vocab, ordered, unk_token=ts.unk_piece, fuse_unk=True, byte_fallback=ts.byte_fallback))
    else:
        raise TokenizerExportError(
            f"{model_file}: sentencepiece model type {ts.model_type} (char/word) has no "
            "Hugging Face equivalent; use bpe or unigram"
        )
    norm: list[Any] = []
    if ns.precompiled_charsmap:
        norm.append(normalizers.Precompiled(ns.precompiled_charsmap))
    if ns.remove_extra_whitespaces:
        norm += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    prepend = "always" if ns.add_dummy_prefix else "never"
    if ts.allow_whitespace_only_pieces and ts.split_by_whitespace:
        # sentencepiece's SplitIntoWords with allow_whitespace_only_pieces: a word starts at the first "▁" of a
        # run and holds the rest of the run and the characters after it ("▁a▁▁▁b" -> "▁a", "▁▁▁b"), where
        # Metaspace(split=True) would start one at every "▁" (the model's "▁▁" pieces then never match)
        # (the dummy prefix as a normalizer, as Llama 2's tokenizer.json has it: Metaspace adds none to a text
        # that starts with a space, sentencepiece always does)
        norm += ([normalizers.Prepend("▁")] if ns.add_dummy_prefix else []) + [normalizers.Replace(" ", "▁")]
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("▁+[^▁]*|[^▁]+"), behavior="isolated")
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme=prepend, split=ts.split_by_whitespace
        )
    tok.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if ns.add_dummy_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    # control pieces (<s>, </s>) are special; user-defined symbols are ordinary added tokens
    tok.add_tokens(
        [AddedToken(p.piece, normalized=False, special=p.type == 3) for p in proto.pieces if p.type in (3, 4)]
    )
    return tok, proto


def _piece(proto, i: int) -> str | None:
    return proto.pieces[i].piece if 0 <= i < len(proto.pieces) else None


def export_tokenizer(
    tok: dict[str, Any], out: Path, *, base: Path | None = None, model_max_length: int | None = None
) -> dict:
    """Write the tokenizer files of a blend.json tokenizer block into ``out``; returns special-token ids."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    kind, files = tok.get("kind"), tok.get("files", {})
    eod_id = tok.get("eod_id")
    cfg: dict[str, Any] = {"add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False}
    if model_max_length:
        cfg["model_max_length"] = model_max_length
    specials: dict[str, Any] = {}
    if kind == "gpt2-bpe":
        from snakellm.tokenize.encoders import _read_gpt2_files

        vf, mf = _resolve(files["vocab_file"], base), _resolve(files["merges_file"], base)
        vocab, merges = _read_gpt2_files(str(vf), str(mf))
        eod = tok.get("eod_token") or "<|endoftext|>"
        shutil.copyfile(vf, out / "vocab.json")
        shutil.copyfile(mf, out / "merges.txt")
        t = Tokenizer(BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        t.decoder = decoders.ByteLevel()
        t.post_processor = processors.ByteLevel(trim_offsets=False)
        from tokenizers import AddedToken

        t.add_special_tokens([AddedToken(eod, special=True, normalized=False)])
        t.save(str(out / "tokenizer.json"))
        cfg.update(tokenizer_class="GPT2Tokenizer", add_prefix_space=False, bos_token=eod, eos_token=eod, unk_token=eod)
        specials = {"bos_token_id": vocab[eod], "eos_token_id": vocab[eod]}
    elif kind == "sentencepiece":
        mf = _resolve(files["model_file"], base)
        t, proto = sentencepiece_tokenizer_json(mf)
        t.save(str(out / "tokenizer.json"))
        shutil.copyfile(mf, out / "tokenizer.model")
        ts = proto.trainer_spec
        eos = _piece(proto, eod_id if eod_id is not None else ts.eos_id)
        cfg.update(tokenizer_class="PreTrainedTokenizerFast", eos_token=eos, unk_token=_piece(proto, ts.unk_id))
        if _piece(proto, ts.bos_id):
            cfg["bos_token"] = _piece(proto, ts.bos_id)
            specials["bos_token_id"] = ts.bos_id
        if _piece(proto, ts.pad_id):
            cfg["pad_token"] = _piece(proto, ts.pad_id)
            specials["pad_token_id"] = ts.pad_id
        specials["eos_token_id"] = eod_id if eod_id is not None else ts.eos_id
    elif kind == "huggingface":
        tf = _resolve(files["tokenizer_file"], base)
        shutil.copyfile(tf, out / "tokenizer.json")
        t = Tokenizer.from_file(str(tf))
        eod = tok.get("eod_token") or t.id_to_token(int(eod_id or 0))
        cfg.update(tokenizer_class="PreTrainedTokenizerFast", eos_token=eod)
        specials = {"eos_token_id": eod_id}
    else:
        raise TokenizerExportError(f"tokenizer kind {kind!r} cannot be exported (gpt2-bpe, sentencepiece, huggingface)")
    if tok.get("chat_template") is not None:
        cfg["chat_template"] = tok["chat_template"]
    write_json(out / "tokenizer_config.json", cfg)
    write_json(
        out / "special_tokens_map.json",
        {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if k in cfg},
    )
    return specials


def import_tokenizer(hf_dir: Path, out: Path) -> dict:
    """A tokenizer block (as in blend.json) for an HF directory's tokenizer, its files copied into ``out``.

    ``vocab.json`` + ``merges.txt`` -> gpt2-bpe (what Megatron's GPT2BPETokenizer reads);
    ``tokenizer.model`` -> sentencepiece; else ``tokenizer.json`` -> huggingface.
    """
    from snakellm.tokenize import encoders

    cfg = {}
    if (hf_dir / "tokenizer_config.json").is_file():
        cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    eos = cfg.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    out.mkdir(parents=True, exist_ok=True)
    if (hf_dir / "vocab.json").is_file() and (hf_dir / "merges.txt").is_file():
        for f in ("vocab.json", "merges.txt"):
            shutil.copyfile(hf_dir / f, out / f)
        t = encoders.load(
            "gpt2-bpe",
            name=hf_dir.name,
            vocab_file=str(out / "vocab.json"),
            merges_file=str(out / "merges.txt"),
            eod=eos,
        )
    elif (hf_dir / "tokenizer.model").is_file():
        shutil.copyfile(hf_dir / "tokenizer.model", out / "tokenizer.model")
        t = encoders.load("sentencepiece", name=hf_dir.name, model_file=str(out / "tokenizer.model"), eod=eos)
    elif (hf_dir / "tokenizer.json").is_file():
        shutil.copyfile(hf_dir / "tokenizer.json", out / "tokenizer.json")
        t = encoders.load("huggingface", name=hf_dir.name, tokenizer_file=str(out / "tokenizer.json"), eod=eos)
    else:
        raise TokenizerExportError(
            f"{hf_dir}: no tokenizer files (vocab.json+merges.txt, tokenizer.model or tokenizer.json)"
        )
    # the chat template stays with the run (snakellm serve's /v1/chat/completions renders it)
    for f in ("tokenizer_config.json", "chat_template.jinja"):
        if (hf_dir / f).is_file():
            shutil.copyfile(hf_dir / f, out / f)
    info = t.info()
    info["nemo"] = encoders.nemo_tokenizer(info)
    template = chat_template(hf_dir, cfg)
    if template is not None:
        info["chat_template"] = template  # travels to export's tokenizer_config.json
    return info


def chat_template(hf_dir: Path, cfg: dict[str, Any]) -> Any:
    """The directory's chat template: ``chat_template.jinja`` (transformers 5) or tokenizer_config's key."""
    jinja = hf_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    return cfg.get("chat_template")
