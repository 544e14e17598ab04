"""Load a tokenizer from its files and encode batches of documents fast.

Three kinds, each with the fastest encoder that gives the reference ids:

``gpt2-bpe``
    GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt`` (what Megatron's
    ``GPT2BPETokenizer`` takes). Encoded with ``tiktoken``, whose mergeable ranks
    are rebuilt from the two files exactly as ``tiktoken_ext.openai_public``
    builds its own ``gpt2`` encoding; tiktoken merges by token rank, which is
    only the same as merging by merge priority when every merge's result has an
    id that grows with the merge's line number (true of GPT-2). Files where that
    does not hold fall back to the Rust ``tokenizers`` BPE, which is exact for
    any vocab/merges pair. Special tokens in the text are encoded as ordinary
    text, as Megatron's legacy tokenizer does.
``sentencepiece``
    a ``.model`` file, encoded by ``sentencepiece`` itself; EOD is the model's
    ``eos`` piece unless another piece is named (Megatron's
    ``GPTSentencePieceTokenizer`` and NeMo use ``eos``).
``huggingface``
    any ``tokenizer.json``. Byte-level BPE files that tiktoken can express exactly
    (Llama 3, Qwen 2, GPT-NeoX, GPT-2 shapes; see ``bytelevel_bpe``) run on tiktoken,
    everything else on the Rust ``tokenizers`` library with truncation and padding
    off; ``encoder_reason`` says which and why. EOD is the named token.

``encode_batch`` is called from several threads at once: each backend releases
the GIL while it encodes, so threads give real parallelism. The tiktoken paths
give each encoder thread an ``Encoding`` of its own (``prepare_threads``, see
``ThreadEncodings``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
import unicodedata
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import orjson

from snakellm.errors import StepFailed
from snakellm.tokenize.bytelevel_bpe import bytes_to_unicode

KINDS = ("gpt2-bpe", "sentencepiece", "huggingface")
GPT2_EOD = "<|endoftext|>"
# GPT-2's pre-tokenizer regex (tiktoken_ext.openai_public.r50k_pat_str; Megatron's gpt2_tokenization.py)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class TokenizerError(StepFailed, ValueError):
    """A tokenizer that cannot be used, phrased with the file at fault."""


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while buf := fh.read(1 << 20):
            h.update(buf)
    return h.hexdigest()


def _require(path: str | None, what: str) -> Path:
    if not path:
        raise TokenizerError(f"no {what} given")
    p = Path(path)
    if not p.is_file():
        raise TokenizerError(f"{path}: {what} not found")
    return p


class ThreadEncodings:
    """One tiktoken ``Encoding`` per encoder thread, built before the encoding starts.

    tiktoken's split regex (fancy_regex over regex-automata) keeps its search caches in pools
    that every thread using the ``Encoding`` shares, and only the first thread that used a pool
    takes its lock-free path; every other thread locks and unlocks a stack of caches on each
    search. Measured on the Llama-3-shaped 128k file: the second thread on a shared ``Encoding``
    spends about 20% more CPU per token than the first. An ``Encoding`` of its own (same ranks,
    pattern and special tokens, so the same ids) makes each worker the first user of its pools;
    building one costs about 0.1 s for a 128k vocabulary, freeing it about 0.03 s. So that a
    worker's exit does not pay the latter, the ``Encoding`` it had is kept until the next
    ``reserve`` (the next chunk's start) or until the tokenizer itself goes.
    """

    def __init__(self, base, build) -> None:
        self.base = base  # serves the first thread that finds no spare, and every thread after that
        self._build = build
        self._spare: list = []
        self._taken: list[tuple[threading.Thread, object]] = []  # handed out: (thread, Encoding)
        self._base_used = False
        self._local = threading.local()
        self._lock = threading.Lock()

    def reserve(self, threads: int) -> None:
        """Have an unused ``Encoding`` ready for each of ``threads`` new threads (the base, while unused, is one)."""
        with self._lock:
            self._taken = [(t, e) for t, e in self._taken if t.is_alive()]  # frees those of finished threads
            while len(self._spare) < threads - (0 if self._base_used else 1):
                self._spare.append(self._build())

    def get(self):
        """This thread's ``Encoding``: a spare one on its first call, else the shared base."""
        enc = getattr(self._local, "enc", None)
        if enc is None:
            with self._lock:
                if self._spare:
                    enc = self._spare.pop()
                    self._taken.append((threading.current_thread(), enc))
                else:
                    enc, self._base_used = self.base, True
            self._local.enc = enc
        return enc


class Tokenizer:
    """What ``tokenize`` and ``blend`` need of a tokenizer."""

    kind: str = ""
    backend: str = ""

    def __init__(self, name: str, files: dict[str, str], vocab_size: int, eod_id: int, eod_token: str) -> None:
        self.name = name
        self.files = files
        self.vocab_size = vocab_size
        self.eod_id = eod_id
        self.eod_token = eod_token
        self.encoder_reason = ""  # why this encoder (backend) runs: recorded in the stats and logged

    @property
    def can_verify(self) -> bool:
        """Whether ``encode_batch`` is a fast path that ``reference_batch`` checks."""
        return False

    def reference_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of the tokenizer's own library (only where ``can_verify``)."""
        raise NotImplementedError

    def use_reference(self, reason: str) -> None:
        """Encode with the reference library from now on (only where ``can_verify``)."""
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list:
        """Token ids of each text (arrays or lists of ints), without EOD; thread-safe."""
        raise NotImplementedError

    def prepare_threads(self, threads: int) -> None:
        """Get ready for ``threads`` new threads calling ``encode_batch`` at once (part of loading)."""

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.encode_batch([text])[0]]

    def decode(self, ids) -> str:
        raise NotImplementedError

    def info(self) -> dict:
        """Everything a trainer needs to rebuild this tokenizer (recorded in stats and blend.json)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "backend": self.backend,
            "encoder_reason": self.encoder_reason,
            "vocab_size": self.vocab_size,
            "eod_id": self.eod_id,
            "eod_token": self.eod_token,
            "files": dict(self.files),
            "sha256": {k: sha256_file(v) for k, v in self.files.items()},
        }


# ----------------------------------------------------------------------------- gpt2-bpe


def _read_gpt2_files(vocab_file: str, merges_file: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    vp = _require(vocab_file, "GPT-2 vocab file (vocab.json)")
    mp = _require(merges_file, "GPT-2 merges file (merges.txt)")
    try:
        vocab = json.loads(vp.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{vocab_file}: not a JSON vocab: {e}") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise TokenizerError(f"{vocab_file}: expected a JSON object of token -> integer id")
    merges = []
    for n, line in enumerate(mp.read_text(encoding="utf-8").splitlines(), start=1):
        if not line or (n == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise TokenizerError(f"{merges_file}:{n}: expected two space-separated symbols, got {line!r}")
        merges.append((parts[0], parts[1]))
    return vocab, merges


def _tiktoken_ranks(vocab: dict[str, int], merges: list[tuple[str, str]], eod: str) -> dict[bytes, int] | None:
    """tiktoken mergeable ranks equal to ``vocab``, or None when rank order != merge order."""
    dec = {c: b for b, c in bytes_to_unicode().items()}
    try:
        ranks = {bytes(dec[c] for c in tok): i for tok, i in vocab.items() if tok != eod}
    except KeyError:
        return None  # tokens outside the byte alphabet: not plain byte-level BPE
    if len(ranks) != len(vocab) - (eod in vocab):
        return None
    byte_ids = [ranks[bytes([b])] for b in range(256) if bytes([b]) in ranks]
    if len(byte_ids) != 256:
        return None
    last = max(byte_ids)
    seen = set()
    for a, b in merges:
        tok = a + b
        made = vocab.get(tok)
        if made is None or made <= last or tok in seen:
            return None
        seen.add(tok)
        last = made
    if len(ranks) != 256 + len(merges):
        return None  # extra non-merge tokens: tiktoken would merge into them
    return ranks


class GPT2BPE(Tokenizer):
    kind = "gpt2-bpe"

    def __init__(
        self, name: str, vocab_file: str, merges_file: str, eod: str = GPT2_EOD, backend: str = "auto"
    ) -> None:
        vocab, merges = _read_gpt2_files(vocab_file, merges_file)
        if eod not in vocab:
            raise TokenizerError(f"{vocab_file}: the EOD token {eod!r} is not in the vocabulary")
        super().__init__(
            name, {"vocab_file": str(vocab_file), "merges_file": str(merges_file)}, len(vocab), vocab[eod], eod
        )
        ranks = _tiktoken_ranks(vocab, merges, eod) if backend in ("auto", "tiktoken") else None
        if ranks is not None:
            import tiktoken

            specials = {eod: vocab[eod]}
            n_vocab = len(vocab) if max(vocab.values()) == len(vocab) - 1 else None

            def build():
                return tiktoken.Encoding(
                    f"snakellm-{name}",
                    pat_str=GPT2_PATTERN,
                    mergeable_ranks=ranks,
                    special_tokens=specials,
                    explicit_n_vocab=n_vocab,
                )

            self._enc = build()
            self._threads = ThreadEncodings(self._enc, build)
            self.backend = "tiktoken"
            self.encoder_reason = "merges in id order: expressed exactly as tiktoken ranks"
        elif backend == "tiktoken":
            raise TokenizerError(
                f"{merges_file}: merge order differs from the vocab's id order; tiktoken cannot encode it"
            )
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallel across our worker threads instead
            from tokenizers import Tokenizer as HFTokenizer
            from tokenizers import decoders, models, pre_tokenizers

            tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            self._hf = tok
            self.backend = "tokenizers"
            self.encoder_reason = (
                "tokenizers requested (--backend tokenizers)"
                if backend == "tokenizers"
                else "merge order differs from the vocabulary's id order (tiktoken merges by id)"
            )

    def prepare_threads(self, threads: int) -> None:
        if self.backend == "tiktoken":
            self._threads.reserve(threads)

    def encode_batch(self, texts: Sequence[str]) -> list:
        if self.backend == "tiktoken":
            enc = self._threads.get()
            if hasattr(enc, "encode_to_numpy"):  # tiktoken >= 0.8: no Python int per token
                return [enc.encode_to_numpy(t, disallowed_special=()) for t in texts]
            return [enc.encode_ordinary(t) for t in texts]
        return [e.ids for e in self._hf.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.backend == "tiktoken":
            return self._enc.decode(ids)
        return self._hf.decode(ids, skip_special_tokens=False)

    def decode_bytes(self, ids) -> bytes:
        if self.backend == "tiktoken":
            return self._enc.decode_bytes([int(i) for i in ids])
        return self.decode(ids).encode("utf-8", "surrogatepass")


# ----------------------------------------------------------------------------- sentencepiece


class SentencePiece(Tokenizer):
    kind = "sentencepiece"
    backend = "sentencepiece"

    def __init__(self, name: str, model_file: str, eod: str | None = None) -> None:
        import sentencepiece as spm

        p = _require(model_file, "SentencePiece model")
        sp = spm.SentencePieceProcessor()
        try:
            sp.Load(str(p))
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"{model_file}: not a SentencePiece model: {e}") from None
        if eod is None:
            eod_id = sp.eos_id()
            if eod_id < 0:
                raise TokenizerError(f"{model_file}: the model has no eos piece (eos_id=-1); name an EOD piece")
            eod = sp.id_to_piece(eod_id)
        else:
            eod_id = sp.piece_to_id(eod)
            if eod_id == sp.unk_id() and eod != sp.id_to_piece(sp.unk_id()):
                raise TokenizerError(f"{model_file}: the EOD piece {eod!r} is not in the vocabulary")
        super().__init__(name, {"model_file": str(model_file)}, sp.vocab_size(), eod_id, eod)
        self._sp = sp
        self._numpy = True

    def encode_batch(self, texts: Sequence[str]) -> list:
        texts = list(texts)
        if self._numpy:
            try:
                return self._sp.encode(texts, return_type="numpy", num_threads=1)
            except (TypeError, ValueError):  # sentencepiece < 0.2.1 has no numpy output
                self._numpy = False
        return self._sp.encode(texts, out_type=int, num_threads=1)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


# ----------------------------------------------------------------------------- huggingface


class HuggingFace(Tokenizer):
    """A ``tokenizer.json``: on tiktoken when it is byte-level BPE tiktoken can express exactly, else ``tokenizers``.

    Text that spells a special token (``<|end_of_text|>``) is encoded as ordinary text on
    both paths (tokenizers' ``encode_special_tokens``), so a document can never inject a
    control token; ``add_special_tokens`` adds the post-processor's tokens (Llama 3's BOS).
    """

    kind = "huggingface"

    def __init__(
        self, name: str, tokenizer_file: str, eod: str | None, add_special_tokens: bool = False, backend: str = "auto"
    ) -> None:
        # one encode_batch per worker thread; rayon's own pool would oversubscribe the job's threads
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        from tokenizers import Tokenizer as HFTokenizer

        p = _require(tokenizer_file, "tokenizer.json")
        try:
            text = p.read_text(encoding="utf-8")
            tok = HFTokenizer.from_str(text)
        except Exception as e:  # the Rust side raises a bare Exception
            raise TokenizerError(f"{tokenizer_file}: not a tokenizers JSON file: {e}") from None
        tok.no_truncation()
        tok.no_padding()
        tok.encode_special_tokens = True
        if not eod:
            raise TokenizerError(f"{tokenizer_file}: name the EOD token of a huggingface tokenizer (eod)")
        eod_id = tok.token_to_id(eod)
        if eod_id is None:
            raise TokenizerError(f"{tokenizer_file}: the EOD token {eod!r} is not in the vocabulary")
        super().__init__(
            name, {"tokenizer_file": str(tokenizer_file)}, tok.get_vocab_size(with_added_tokens=True), eod_id, eod
        )
        self._tok = tok
        self._special = add_special_tokens
        self._plan = None
        self.backend = "tokenizers"
        if backend == "tokenizers":
            self.encoder_reason = "tokenizers requested (--backend tokenizers)"
            return
        from snakellm.tokenize import bytelevel_bpe

        try:
            spec = orjson.loads(text)
            self._plan = bytelevel_bpe.plan(spec, add_special_tokens, reachable=lambda ts: _rebuilt(tok, ts))
        except bytelevel_bpe.NotExpressible as e:
            if backend == "tiktoken":
                raise TokenizerError(f"{tokenizer_file}: tiktoken cannot encode it exactly: {e}") from None
            self.encoder_reason = f"not expressible in tiktoken: {e}"
            return
        self.backend = "tiktoken"
        self.encoder_reason = self._plan.reason
        self._threads = ThreadEncodings(self._plan.encoding, self._plan.build)

    def prepare_threads(self, threads: int) -> None:
        if self._plan is not None:
            self._threads.reserve(threads)

    @property
    def can_verify(self) -> bool:
        return self.backend == "tiktoken"

    def use_reference(self, reason: str) -> None:
        """Encode with ``tokenizers`` from now on (after the verification found a difference)."""
        self.backend, self.encoder_reason, self._plan = "tokenizers", reason, None

    def reference_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids ``tokenizers`` gives, what the tiktoken path must equal."""
        return [e.ids for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=self._special)]

    def encode_batch(self, texts: Sequence[str]) -> list:
        plan = self._plan
        if plan is None:
            return self.reference_batch(texts)
        if plan.nfc:
            texts = [unicodedata.normalize("NFC", t) for t in texts]
        enc = self._threads.get()
        if hasattr(enc, "encode_to_numpy"):  # tiktoken >= 0.8: no Python int per token
            out = [enc.encode_to_numpy(t, disallowed_special=()) for t in texts]
        else:
            out = [np.asarray(enc.encode_ordinary(t), dtype=np.uint32) for t in texts]
        if plan.prefix or plan.suffix:
            pre, suf = (np.asarray(x, dtype=np.uint32) for x in (plan.prefix, plan.suffix))
            out = [np.concatenate([pre, a, suf]) for a in out]
        return out

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _rebuilt(tok, tokens: list[str]) -> list[bool]:
    """For each vocabulary token, whether the file's BPE (merges only) turns its symbols back into it."""
    model = tok.model  # the BPE model alone: no normalizer, pre-tokenizer or added tokens
    return [len(model.tokenize(t)) == 1 for t in tokens]


# ----------------------------------------------------------------------------- loading


def load(
    kind: str,
    *,
    name: str = "",
    vocab_file: str | None = None,
    merges_file: str | None = None,
    model_file: str | None = None,
    tokenizer_file: str | None = None,
    eod: str | None = None,
    add_special_tokens: bool = False,
    expected_vocab_size: int | None = None,
    backend: str = "auto",
) -> Tokenizer:
    """Load a tokenizer and check it against the configured vocab size."""
    if kind == "gpt2-bpe":
        tok: Tokenizer = GPT2BPE(name or "gpt2", vocab_file, merges_file, eod or GPT2_EOD, backend=backend)  # type: ignore[arg-type]
    elif kind == "sentencepiece":
        tok = SentencePiece(name or Path(model_file or "").stem, model_file, eod)  # type: ignore[arg-type]
    elif kind == "huggingface":
        tok = HuggingFace(name or "huggingface", tokenizer_file, eod, add_special_tokens, backend)  # type: ignore[arg-type]
    else:
        raise TokenizerError(f"unknown tokenizer kind {kind!r}; expected one of {', '.join(KINDS)}")
    if expected_vocab_size is not None and tok.vocab_size != expected_vocab_size:
        where = next(iter(tok.files.values()))
        raise TokenizerError(
            f"{where}: the tokenizer has {tok.vocab_size} tokens but the config says vocab_size {expected_vocab_size}"
        )
    return tok


def megatron_args(info: dict) -> list[str]:
    """Megatron-LM ``pretrain_gpt.py`` tokenizer flags for a tokenizer ``info()``."""
    f = info["files"]
    if info["kind"] == "gpt2-bpe":
        return [
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            f["vocab_file"],
            "--merge-file",
            f["merges_file"],
        ]
    if info["kind"] == "sentencepiece":
        return ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", f["model_file"]]
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(Path(f["tokenizer_file"]).parent)]


def nemo_tokenizer(info: dict) -> dict:
    """NeMo 1.x ``model.tokenizer`` config for a tokenizer ``info()``."""
    f = info["files"]
    if info["kind"] == "gpt2-bpe":
        return {
            "library": "megatron",
            "type": "GPT2BPETokenizer",
            "vocab_file": f["vocab_file"],
            "merge_file": f["merges_file"],
        }
    if info["kind"] == "sentencepiece":
        return {"library": "sentencepiece", "model": f["model_file"]}
    return {"library": "huggingface", "type": str(Path(f["tokenizer_file"]).parent), "use_fast": True}


# ----------------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The tokenizer options shared by the steps that load one."""
    from snakellm.config.sections import TokenizerSettings
    from snakellm.config.settings import add_arguments as add_settings

    g = p.add_argument_group("tokenizer (config: tokenizers.NAME)")
    add_settings(g, TokenizerSettings)
    g.add_argument("--name", default="", help="the tokenizer's name in the config (recorded in stats and the blend)")
    g.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "tiktoken", "tokenizers"),
        help="gpt2-bpe and huggingface encoder (default auto: tiktoken when it gives exactly the ids of the "
        "tokenizer's own library, else tokenizers; tiktoken: fail instead of falling back)",
    )


def from_args(a: argparse.Namespace) -> Tokenizer:
    return load(
        a.kind,
        name=a.name,
        vocab_file=a.vocab_file,
        merges_file=a.merges_file,
        model_file=a.model_file,
        tokenizer_file=a.tokenizer_file,
        eod=a.eod,
        add_special_tokens=bool(a.add_special_tokens),
        expected_vocab_size=a.vocab_size,
        backend=a.backend,
    )
