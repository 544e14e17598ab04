"""``.nemo`` files: our megatron-core checkpoints in NeMo 1.x's layout, and back.

A ``.nemo`` is what NeMo's ``SaveRestoreConnector._make_nemo_file_from_folder``
writes: an *uncompressed* tar of one folder added as ``.`` (members ``./...``)::

    ./model_config.yaml          the model cfg at top level (mcore_gpt: true, every key MegatronGPTModel reads)
    ./<uuid4hex>_tokenizer.model tokenizer files, referenced from the yaml as ``nemo:<uuid4hex>_<name>``
    ./model_weights/             megatron.core.dist_checkpointing, torch_dist, keys ``model.`` + mcore's names
        .metadata __0_0.distcp __0_1.distcp common.pt metadata.json

Two things make the file readable by more than the newest NeMo
(docs/export-and-serving.md, "Which NeMo reads the file"):

* ``.metadata`` is rewritten without ``storage_meta`` (a ``StorageMeta`` object
  that torch < 2.4, i.e. the 24.05/24.07 containers, cannot unpickle) and
  without megatron-core's ``all_local_plans``; both are only used when saving.
* Llama-style (RMSNorm) models are marked ``transformer_engine: true``: megatron-core
  0.8 (the 24.07 container) builds RMSNorm only with Transformer Engine. A TE model
  asks for one more key, ``core_attention._extra_state`` (FP8 bookkeeping, empty
  outside FP8), so the yaml also says ``dist_ckpt_load_strictness: log_all``.

The reverse direction (:func:`import_nemo`) reads a ``.nemo`` (a tar or an
extracted folder) that NeMo's ``save_to`` wrote and writes a model-only
checkpoint that ``snakellm.models.load`` and fine-tuning start from.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tarfile
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from snakellm.errors import UsageError
from snakellm.io.atomic import atomic_path
from snakellm.models import families

NEMO_TARGET = "nemo.collections.nlp.models.language_modeling.megatron_gpt_model.MegatronGPTModel"
WEIGHTS_DIR = "model_weights"
CONFIG_FILE = "model_config.yaml"
TE_CHOICES = ("auto", "true", "false")


class NemoError(UsageError, ValueError):
    """A checkpoint or ``.nemo`` that cannot be converted, phrased with the file and the reason."""


# ----------------------------------------------------------------------------- config <-> architecture


def transformer_engine_for(arch: dict[str, Any], choice: str = "auto") -> bool:
    """``auto``: TE for RMSNorm (megatron-core 0.8 has no other RMSNorm), local spec for LayerNorm."""
    if choice == "auto":
        return arch["normalization"] == "RMSNorm"
    return choice == "true"


@dataclass(frozen=True)
class NemoKey:
    """One architecture key of ``model_config.yaml`` and ours (both directions read this row).

    ``values``: NeMo's spelling -> ours, for keys with a fixed set of values (export writes the
    first NeMo spelling of ours; import refuses one not listed, naming the choices). ``default``:
    what NeMo assumes when the key is absent or null (None: required). ``export_only``: written for NeMo,
    derived from another key.
    """

    nemo: str
    ours: str
    default: Any = None
    values: dict[Any, Any] | None = None
    cast: Callable[[Any], Any] = lambda v: v
    export_only: bool = False

    def to_nemo(self, value: Any) -> Any:
        if self.values is None:
            return value
        return next(k for k, v in self.values.items() if v == value)

    def from_nemo(self, cfg: dict[str, Any], where: str) -> Any:
        value = cfg.get(self.nemo)
        if value is None:  # absent, or null as NeMo's own configs write an unset key
            value = self.default
        if value is None:
            raise NemoError(f"{where}: model_config.yaml has no {self.nemo!r}")
        if self.values is None:
            return self.cast(value)
        value = self.cast(value)
        if value not in self.values:
            raise NemoError(f"{where}: {self.nemo} {value!r} is not supported ({', '.join(self.values)})")
        return self.values[value]


# NeMo's megatron_gpt_config.yaml / megatron_llama_config.yaml keys, which NeMo copies by name into
# megatron-core's TransformerConfig: they must say exactly what our model is (a wrong num_query_groups
# fails NeMo's load with a shape mismatch; a wrong activation would load and compute something else)
NEMO_KEYS: tuple[NemoKey, ...] = (
    NemoKey("encoder_seq_length", "seq_length"),
    NemoKey("max_position_embeddings", "seq_length", export_only=True),
    NemoKey("num_layers", "num_layers"),
    NemoKey("hidden_size", "hidden_size"),
    NemoKey("ffn_hidden_size", "ffn_hidden_size"),
    NemoKey("num_attention_heads", "num_attention_heads"),
    NemoKey("num_query_groups", "num_query_groups", default=0),  # 0/None: one per head
    NemoKey("init_method_std", "init_method_std", 0.02, cast=float),
    NemoKey("hidden_dropout", "hidden_dropout", 0.1, cast=float),
    NemoKey("attention_dropout", "attention_dropout", 0.1, cast=float),
    NemoKey(
        "position_embedding_type",
        "position_embedding",
        "learned_absolute",
        {"learned_absolute": "learned", "rope": "rope"},
    ),
    NemoKey("rotary_base", "rotary_base", 10000),
    NemoKey("normalization", "normalization", "layernorm", {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}, str.lower),
    NemoKey("layernorm_epsilon", "layernorm_epsilon", 1e-5, cast=float),
    NemoKey("make_vocab_size_divisible_by", "make_vocab_size_divisible_by", 128, cast=int),
    NemoKey("bias", "bias", True, cast=bool),
    NemoKey("qkv_bias", "bias", export_only=True),
    NemoKey("activation", "activation", "gelu", {"gelu": "gelu", "swiglu": "swiglu", "fast-swiglu": "swiglu"}),
    NemoKey("share_embeddings_and_output_weights", "tie_embeddings", True, cast=bool),
)

# everything else MegatronGPTModel reads: one process, no fusions, inference-ready defaults
_NEMO_FIXED: dict[str, Any] = {
    "micro_batch_size": 1,
    "global_batch_size": 1,
    "rampup_batch_size": None,
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,
    "use_scaled_init_method": True,
    "ffn_dropout": 0.0,
    "rotary_percentage": 1.0,
    "apply_query_key_layer_scaling": False,
    "do_layer_norm_weight_decay": False,
    "pre_process": True,
    "post_process": True,
    "persist_layer_norm": False,
    "headscale": False,
    "transformer_block_type": "pre_ln",
    "openai_gelu": False,
    "normalize_attention_scores": True,
    "attention_type": "multihead",
    "megatron_amp_O2": False,
    "native_amp_init_scale": 4294967296,
    "native_amp_growth_interval": 1000,
    "hysteresis": 2,
    "fp32_residual_connection": False,
    "fp16_lm_cross_entropy": False,
    "seed": 1234,
    "use_cpu_initialization": False,
    "onnx_safe": False,
    "apex_transformer_log_level": 30,
    "gradient_as_bucket_view": True,
    "sync_batch_comm": False,
    "activations_checkpoint_granularity": None,
    "activations_checkpoint_method": None,
    "activations_checkpoint_num_layers": None,
    "num_micro_batches_with_partial_activation_checkpoints": None,
    "activations_checkpoint_layers_per_pipeline": None,
    "sequence_parallel": False,
    "fp8": False,
    "gradient_accumulation_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_add_fusion": False,
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "get_attention_mask_from_fusion": True,
    "dist_ckpt_format": "torch_dist",
    "dist_ckpt_load_on_device": True,
    "dist_ckpt_parallel_save": False,
}


def _data_and_optim(seq: int) -> dict[str, Any]:
    """The ``data``/``optim`` blocks NeMo's config must have (nothing trains from them here)."""
    return {
        "data": {
            "data_prefix": [],
            "index_mapping_dir": None,
            "data_impl": "mmap",
            "splits_string": "900,50,50",
            "seq_length": seq,
            "skip_warmup": True,
            "num_workers": 0,
            "dataloader_type": "single",
            "reset_position_ids": False,
            "reset_attention_mask": False,
            "eod_mask_loss": False,
        },
        "nsys_profile": {"enabled": False},
        "optim": {
            "name": "fused_adam",
            "lr": 1.0e-4,
            "weight_decay": 0.01,
            "betas": [0.9, 0.98],
            "sched": {"name": "CosineAnnealing", "warmup_steps": 0, "constant_steps": 0, "min_lr": 1.0e-5},
        },
    }


def model_config(
    arch: dict[str, Any],
    padded_vocab: int,
    tokenizer_cfg: dict[str, Any],
    *,
    precision: Any = 32,
    transformer_engine: bool = False,
) -> dict[str, Any]:
    """The ``model_config.yaml`` mapping MegatronGPTModel rebuilds this architecture from.

    The architecture part is :data:`NEMO_KEYS` plus the family's ``nemo_extra``; a family
    whose model NeMo 1.x cannot represent says why (``nemo_refuses``) and nothing is written.
    """
    family = families.get(arch["style"])
    why = family.nemo_refuses(arch)
    if why:
        raise NemoError(f"NeMo 1.x cannot represent this {family.name} model: {why}")
    cfg: dict[str, Any] = {"mcore_gpt": True, **_NEMO_FIXED}
    cfg.update({key.nemo: key.to_nemo(arch[key.ours]) for key in NEMO_KEYS})
    cfg["kv_channels"] = families.head_dim(arch)
    cfg.update(family.nemo_extra(arch))
    cfg["precision"] = precision
    cfg["transformer_engine"] = transformer_engine
    cfg["tokenizer"] = tokenizer_cfg
    cfg.update(_data_and_optim(arch["seq_length"]))
    cfg["target"] = NEMO_TARGET
    if transformer_engine:
        # a TE model also asks for core_attention._extra_state, which a local-spec checkpoint
        # cannot have: log it instead of failing (NeMo >= 2.0.0rc1 reads this key)
        cfg["dist_ckpt_load_strictness"] = "log_all"
    return cfg


def _check_config(cfg: dict[str, Any], where: str) -> None:
    """What a model_config.yaml may say that we cannot rebuild exactly: refused, naming the key."""
    if not cfg.get("mcore_gpt", False):
        raise NemoError(f"{where}: not a megatron-core GPT (mcore_gpt is not true); only mcore GPT .nemo files import")
    for key, ok in (("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1)):
        if cfg.get(key, 1) != ok:
            raise NemoError(f"{where}: {key} is {cfg.get(key)}; only .nemo files saved with 1 import")
    if cfg.get("position_embedding_type") == "rope" and float(cfg.get("rotary_percentage", 1.0)) != 1.0:
        raise NemoError(f"{where}: rotary_percentage {cfg['rotary_percentage']} is not supported (1.0 only)")
    if cfg.get("openai_gelu", False):
        raise NemoError(f"{where}: activation {cfg.get('activation', 'gelu')!r} with openai_gelu is not supported")
    if cfg.get("seq_len_interpolation_factor") not in (None, 1, 1.0):
        raise NemoError(f"{where}: seq_len_interpolation_factor {cfg['seq_len_interpolation_factor']} is not supported")
    h, n = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    if h and n and cfg.get("kv_channels") not in (None, h // n):
        raise NemoError(f"{where}: kv_channels {cfg['kv_channels']} != hidden_size / num_attention_heads")
    for key in ("headscale", "fp32_residual_connection", "qk_layernorm"):
        if cfg.get(key):
            raise NemoError(f"{where}: {key}: true is not supported")
    if cfg.get("transformer_block_type", "pre_ln") != "pre_ln":
        raise NemoError(f"{where}: transformer_block_type {cfg['transformer_block_type']!r} is not supported (pre_ln)")


@contextlib.contextmanager
def _as_nemo_error() -> Iterator[None]:
    """A family's refusal, raised as this module's error."""
    try:
        yield
    except families.FamilyError as e:
        raise NemoError(str(e)) from None


def arch_from_config(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """Our architecture dict for a NeMo ``model_config.yaml``; anything we cannot rebuild exactly is an error."""
    from snakellm.models import architecture

    _check_config(cfg, where)
    overrides = {key.ours: key.from_nemo(cfg, where) for key in NEMO_KEYS if not key.export_only}
    overrides["num_query_groups"] = overrides["num_query_groups"] or overrides["num_attention_heads"]
    family = families.for_nemo(
        cfg, overrides["position_embedding"], overrides["normalization"], overrides["activation"]
    )
    overrides["style"] = family.name
    if cfg.get("qkv_bias") and not overrides["bias"] and "qkv_bias" not in family.arch_keys:
        raise NemoError(f"{where}: qkv_bias without bias is not supported for a {family.name} model")
    for key in ("scale_positional_embedding", "sliding_window"):  # what only a family that claims it reads
        if cfg.get(key) and family.nemo_claims is None:
            raise NemoError(f"{where}: {key} {cfg[key]!r} is not supported for a {family.name} model")
    with _as_nemo_error():
        overrides.update(family.nemo_import_extra(cfg, where))
    try:
        return architecture.resolve(None, overrides)
    except architecture.ModelConfigError as e:
        raise NemoError(f"{where}: {e}") from None


# ----------------------------------------------------------------------------- tokenizer artifacts

_TOKENIZER_FILES = {  # our tokenizer kind -> (our files key, NeMo tokenizer key)
    "gpt2-bpe": (("vocab_file", "vocab_file"), ("merges_file", "merge_file")),
    "sentencepiece": (("model_file", "model"),),
}


def check_tokenizer(tok: dict[str, Any], where: str) -> None:
    """A tokenizer we can pack: its kind has NeMo artifact files and they exist."""
    kind = tok.get("kind")
    if kind not in _TOKENIZER_FILES:
        raise NemoError(
            f"{where}: tokenizer kind {kind!r} cannot be packed into a .nemo (NeMo packs only GPT-2 BPE "
            "vocab/merges and SentencePiece models; a Hugging Face tokenizer.json is a directory reference)"
        )
    for ours, _ in _TOKENIZER_FILES[kind]:
        f = tok.get("files", {}).get(ours)
        if not f or not Path(f).is_file():
            raise NemoError(f"{where}: tokenizer file {ours} {f!r} not found")


def pack_tokenizer(tok: dict[str, Any], dest: Path) -> dict[str, Any]:
    """Copy the tokenizer files into ``dest`` as NeMo names them; return the yaml ``tokenizer:`` block.

    NeMo's ``_handle_artifacts`` names a packed file ``f"{uuid.uuid4().hex}_{basename}"``
    and writes ``"nemo:" + name`` into the config; a fresh uuid per save, like NeMo.
    """
    cfg: dict[str, Any]
    if tok["kind"] == "gpt2-bpe":
        cfg = {
            "library": "megatron",
            "type": "GPT2BPETokenizer",
            "model": None,
            "vocab_file": None,
            "merge_file": None,
            "delimiter": None,
            "sentencepiece_legacy": False,
        }
    else:
        cfg = {
            "library": "sentencepiece",
            "type": None,
            "model": None,
            "vocab_file": None,
            "merge_file": None,
            "delimiter": None,
            "sentencepiece_legacy": False,
        }
    for ours, theirs in _TOKENIZER_FILES[tok["kind"]]:
        src = Path(tok["files"][ours])
        name = f"{uuid.uuid4().hex}_{src.name}"
        shutil.copyfile(src, dest / name)
        cfg[theirs] = f"nemo:{name}"
    return cfg


def unpack_tokenizer(cfg: dict[str, Any], root: Path, dest: Path, where: str) -> dict[str, Any]:
    """The ``.nemo``'s tokenizer files copied to ``dest`` under plain names -> our tokenizer block."""
    from snakellm.tokenize import encoders

    lib = cfg.get("library")

    def artifact(key: str) -> Path:
        ref = cfg.get(key)
        if not ref:
            raise NemoError(f"{where}: tokenizer.{key} is missing")
        name = ref[5:] if str(ref).startswith("nemo:") else Path(ref).name
        p = root / name
        if not p.is_file():
            raise NemoError(f"{where}: tokenizer.{key} {ref!r} is not in the archive")
        return p

    dest.mkdir(parents=True, exist_ok=True)
    if lib == "megatron" and cfg.get("type") in ("GPT2BPETokenizer", None):
        vocab, merges = dest / "vocab.json", dest / "merges.txt"
        shutil.copyfile(artifact("vocab_file"), vocab)
        shutil.copyfile(artifact("merge_file"), merges)
        tok = encoders.load("gpt2-bpe", name="gpt2", vocab_file=str(vocab), merges_file=str(merges))
    elif lib == "sentencepiece":
        if cfg.get("sentencepiece_legacy"):
            raise NemoError(
                f"{where}: tokenizer.sentencepiece_legacy: true (special tokens added by NeMo) is not supported"
            )
        model = dest / "tokenizer.model"
        shutil.copyfile(artifact("model"), model)
        tok = encoders.load("sentencepiece", name="tokenizer", model_file=str(model))
    else:
        raise NemoError(
            f"{where}: tokenizer library {lib!r} type {cfg.get('type')!r} is not supported "
            "(megatron GPT2BPETokenizer, sentencepiece)"
        )
    info = tok.info()
    info["nemo"] = encoders.nemo_tokenizer(info)
    info["megatron_args"] = encoders.megatron_args(info)
    return info


# ----------------------------------------------------------------------------- torch_dist helpers


def rewrite_metadata(weights_dir: Path) -> None:
    """Drop the save-time-only parts of ``.metadata`` that older torch cannot unpickle.

    torch >= 2.4 pickles ``storage_meta=StorageMeta(...)`` (a class torch 2.3 lacks) and
    megatron-core adds ``all_local_plans``; loading uses neither (the reader sets a fresh
    ``StorageMeta`` itself when it is None).
    """
    path = weights_dir / ".metadata"
    with open(path, "rb") as fh:
        md = pickle.load(fh)
    md.storage_meta = None
    if hasattr(md, "all_local_plans"):
        del md.all_local_plans
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        pickle.dump(md, fh)


def pickled_globals(path: Path) -> set[tuple[str, str]]:
    """(module, name) of every class/function a pickle refers to (what a reader must have)."""
    found: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found.add((module, name))
            return super().find_class(module, name)

    with open(path, "rb") as fh:
        Recorder(fh).load()
    return found


@contextlib.contextmanager
def model_parallel() -> Iterator[None]:
    """A single-process group + megatron-core's parallel state (1, 1) for the block, unless one exists."""
    import torch

    from snakellm.launch.runtime import ensure_single_process, shutdown

    own = not torch.distributed.is_initialized()
    ensure_single_process("cpu")
    try:
        yield
    finally:
        if own:
            shutdown()


def _drop_extra_state(sd: dict) -> dict:
    """The sharded state without ``_extra_state`` objects (TE/FP8 bookkeeping; not weights)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _drop_extra_state(v)
        elif isinstance(v, ShardedObject) and "_extra_state" in v.key:
            continue
        else:
            out[k] = v
    return out


def load_weights(module: Any, weights_dir: Path, prefix: str) -> None:
    """Load ``module``'s tensors from a dist-checkpoint whose keys carry ``prefix``; every weight must be there."""
    from megatron.core import dist_checkpointing

    from snakellm.io.checkpoint import _in_process_results_queue

    _in_process_results_queue()
    request = _drop_extra_state(module.sharded_state_dict(prefix=prefix))
    try:
        state = dist_checkpointing.load(request, str(weights_dir))
    except Exception as e:  # megatron-core names the key and both shapes
        raise NemoError(f"{weights_dir}: the weights do not match the model config: {e}") from None
    # load() also merges in the checkpoint's common.pt (iteration, run metadata): keep the module's keys
    # (sharded_state_dict(prefix=...) prefixes the dict's keys too)
    state = {k[len(prefix) :]: v for k, v in state.items() if k in request}
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise NemoError(f"{weights_dir}: weights missing {missing} / unexpected {unexpected}")


def save_weights(module: Any, weights_dir: Path, prefix: str) -> None:
    from megatron.core import dist_checkpointing

    from snakellm.io.checkpoint import _in_process_results_queue

    _in_process_results_queue()
    weights_dir.mkdir(parents=True)
    dist_checkpointing.save(
        module.sharded_state_dict(prefix=prefix), str(weights_dir), sharded_strategy=("torch_dist", 1)
    )


# ----------------------------------------------------------------------------- our checkpoints


def read_checkpoint_info(path: str | os.PathLike, iteration: int | None = None) -> dict[str, Any]:
    """What an export needs to know about a checkpoint, torch-free: checked before any work starts."""
    from snakellm.io import checkpoint as ckpt
    from snakellm.models.loading import LoadError, describe_run

    if not Path(path).exists():
        raise NemoError(f"{path}: no such checkpoint (run `snakemake runs/<run>/train_summary.json` first)")
    try:
        info = describe_run(path, iteration)
        rc = ckpt.read_run_config(info["checkpoint_dir"]) or {}
    except (LoadError, ckpt.CheckpointError) as e:
        raise NemoError(str(e)) from None
    info["precision"] = rc.get("config", {}).get("precision", "fp32")
    return info


def build(arch: dict[str, Any], padded_vocab: int, bf16: bool = False) -> Any:
    """Our megatron-core GPTModel (eval mode) on the CPU; the parallel state must exist (:func:`model_parallel`)."""
    from snakellm.models.build import build_model

    module, _ = build_model(arch, padded_vocab, device="cpu", bf16=bf16)
    module.eval()
    return module


# ----------------------------------------------------------------------------- export / import


def export_nemo(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    iteration: int | None = None,
    tokenizer: dict[str, Any] | None = None,
    transformer_engine: str = "auto",
    info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``output`` (.nemo) from one of our checkpoints; returns a summary. Atomic."""
    info = info or read_checkpoint_info(checkpoint, iteration)
    tok = tokenizer or info["tokenizer"]
    if tok is None:
        raise NemoError(f"{info['checkpoint_dir']}: the checkpoint does not record its tokenizer; pass --blend")
    check_tokenizer(tok, str(checkpoint))
    arch, vocab = info["arch"], info["padded_vocab_size"]
    te = transformer_engine_for(arch, transformer_engine)
    from snakellm.export.stream import save_nemo_weights

    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with model_parallel(), tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmpdir:
        folder = Path(tmpdir) / "nemo"
        folder.mkdir()
        tok_cfg = pack_tokenizer(tok, folder)
        # bf16 weights are written upcast to fp32 (lossless): NeMo without megatron_amp_O2 keeps fp32
        # parameters and runs bf16 under autocast, which is what `precision: bf16` asks for
        precision = "bf16" if info["precision"] in ("bf16", "fp8") else 32  # fp8 runs keep bf16 weights
        cfg = model_config(arch, vocab, tok_cfg, precision=precision, transformer_engine=te)
        (folder / CONFIG_FILE).write_text(yaml.safe_dump(cfg, sort_keys=False))
        # one layer in memory at a time (snakellm.export.stream)
        nparams = save_nemo_weights(info, folder / WEIGHTS_DIR, prefix="model.")
        rewrite_metadata(folder / WEIGHTS_DIR)
        with atomic_path(out) as tmp:
            # exactly SaveRestoreConnector._make_nemo_file_from_folder: uncompressed, members ./...
            with tarfile.open(tmp, "w:") as tar:
                _tar_moving(tar, folder)
    return {
        "output": str(out),
        "iteration": info["iteration"],
        "parameters": nparams,
        "transformer_engine": te,
        "tokenizer": tok_cfg,
        "bytes": out.stat().st_size,
    }


def _tar_moving(tar: tarfile.TarFile, folder: Path) -> None:
    """``tar.add(folder, arcname=".")``, each file removed once it is in the archive.

    An 8B model's fp32 weights are 32 GB: holding them twice (folder and archive) is what a
    conversion on a login node's disk cannot afford.
    """
    tar.add(str(folder), arcname=".", recursive=False)
    for p in sorted(folder.rglob("*")):
        tar.add(str(p), arcname=f"./{p.relative_to(folder)}", recursive=False)
        if p.is_file():
            p.unlink()


def _safe_extract(archive: Path, dest: Path) -> None:
    try:
        tar = tarfile.open(archive, "r:")
    except tarfile.ReadError:
        try:
            tar = tarfile.open(archive, "r:gz")  # pre-1.7 NeMo wrote gzip
        except tarfile.ReadError as e:
            raise NemoError(f"{archive}: not a .nemo (tar) file: {e}") from None
    with tar:
        for m in tar.getmembers():
            name = os.path.normpath(m.name)
            if name.startswith(("/", "..")) or not (m.isfile() or m.isdir()):
                raise NemoError(f"{archive}: unsafe member {m.name!r}")
        try:
            tar.extractall(dest, filter="data")
        except (tarfile.TarError, OSError, EOFError) as e:
            raise NemoError(f"{archive}: damaged archive: {e}") from None


def import_nemo(source: str | os.PathLike, run_dir: str | os.PathLike) -> dict[str, Any]:
    """A ``.nemo`` (tar or extracted folder, NeMo 1.x mcore GPT) -> ``run_dir/checkpoints/iter_0000000``."""
    src, run = Path(source), Path(run_dir)
    if not src.exists():
        raise NemoError(f"{src}: no such file")
    from snakellm.io import checkpoint as ckpt

    if (run / "checkpoints").exists() and (
        ckpt.list_iterations(run / "checkpoints") or any((run / "checkpoints").iterdir())
    ):
        raise NemoError(f"{run / 'checkpoints'} already exists and is not empty; import into a new run directory")
    with contextlib.ExitStack() as stack:
        if src.is_dir():
            root = src
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix=".import-nemo."))
            root = Path(tmp)
            _safe_extract(src, root)
        cfg_path = root / CONFIG_FILE
        if not cfg_path.is_file():
            raise NemoError(f"{src}: no {CONFIG_FILE} inside")
        try:
            cfg = yaml.safe_load(cfg_path.read_text())
        except yaml.YAMLError as e:
            raise NemoError(f"{src}: {CONFIG_FILE}: {e}") from None
        if isinstance(cfg, dict) and "model" in cfg and isinstance(cfg["model"], dict):
            cfg = cfg["model"]
        if not isinstance(cfg, dict):
            raise NemoError(f"{src}: {CONFIG_FILE} is not a mapping")
        weights = root / WEIGHTS_DIR
        if not (weights / "metadata.json").is_file():
            raise NemoError(
                f"{src}: no {WEIGHTS_DIR}/ distributed checkpoint (legacy or TP>1 layouts are not supported)"
            )
        arch = arch_from_config(cfg, str(src))
        from snakellm.models import architecture, save_model_checkpoint

        tok = unpack_tokenizer(cfg.get("tokenizer") or {}, root, run / "tokenizer", str(src))
        vocab = architecture.padded_vocab_size(tok["vocab_size"], arch)
        bf16 = str(cfg.get("precision", 32)) in ("bf16", "bf16-mixed") and bool(cfg.get("megatron_amp_O2", False))
        with model_parallel():
            module = build(arch, vocab, bf16=bf16)
            load_weights(module, weights, prefix="model.")
            path = save_model_checkpoint(run, module, arch, vocab, tok, extra={"imported_from": str(src)})
            nparams = sum(p.numel() for p in module.parameters())
    return {"checkpoint": str(path), "parameters": nparams, "arch": arch, "padded_vocab": vocab}


__all__ = ["export_nemo", "import_nemo", "model_config", "arch_from_config", "rewrite_metadata", "NemoError"]
