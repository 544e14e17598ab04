"""Hugging Face import and export in bounded memory: one shard and one layer at a time.

An 8B model is 16 GB in bf16; holding it, plus a converted copy, does not fit a 24 GB login node.
Neither direction here ever holds a whole state dict:

* **Import** (:func:`import_streaming`): megatron-core's ``GPTModel`` is built on the meta device
  (shapes only), and its sharded state dict is saved with megatron-core's own torch_dist layout
  through PyTorch's distributed-checkpoint writer, whose single-threaded file writer asks the
  planner for one tensor at a time (``_SerialCpuLoader``). :class:`_LazyPlanner` answers each request
  by converting that layer from the Hugging Face shards, read tensor by tensor with safetensors'
  ``safe_open``; the write plan is ordered by layer so each layer is converted once.
* **Export** (:func:`export_streaming`): the checkpoint is read one layer at a time (a partial
  ``dist_checkpointing.load`` of that layer's tensors on the same meta model's sharded state dict)
  and written to HF safetensors shards as each fills (:class:`ShardWriter`), with
  ``model.safetensors.index.json`` when there is more than one.

The weight maps themselves are :mod:`snakellm.export.hf`'s per-layer functions, which the
in-memory paths use too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from snakellm.export.hf import ExportError, group_from_hf, group_to_hf

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "I64": "int64"}


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """(entries by name, offset of the data) of a safetensors file: 8-byte length, JSON header, data."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class SafetensorsReader:
    """``name -> tensor`` over a Hugging Face directory's safetensors, reading only the tensor asked for.

    Each tensor is read with one positioned read into its own buffer, from the file's header offsets
    (the format safetensors' ``safe_open`` reads): no file is memory-mapped, so pages of a shard read
    earlier never count towards the process's resident memory.
    """

    def __init__(self, hf_dir: Path) -> None:
        index = hf_dir / "model.safetensors.index.json"
        if (hf_dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
        elif index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            raise ExportError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
        self.entries: dict[str, tuple[Path, dict[str, Any], int]] = {}
        for f in files:
            header, start = read_safetensors_header(hf_dir / f)
            for name, e in header.items():
                self.entries[name] = (hf_dir / f, e, start)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> Any:
        import torch

        path, e, start = self.entries[name]
        if e["dtype"] not in _ST_DTYPES:
            raise ExportError(f"{path}: {name} has dtype {e['dtype']} (float32, bfloat16, float16 only)")
        lo, hi = e["data_offsets"]
        buf = torch.empty(hi - lo, dtype=torch.uint8)
        with open(path, "rb") as f:
            f.seek(start + lo)
            if f.readinto(buf.numpy().data) != hi - lo:
                raise ExportError(f"{path}: {name} is cut short (file truncated?)")
        return buf.view(getattr(torch, _ST_DTYPES[e["dtype"]])).reshape(e["shape"])

    def dtype(self) -> Any:
        """The dtype of the checkpoint's tensors (of its first one)."""
        import torch

        return getattr(torch, _ST_DTYPES.get(next(iter(self.entries.values()))[1]["dtype"], "float32"))


def write_safetensors(path: Path, tensors: dict[str, Any]) -> None:
    """One safetensors file, each tensor's bytes written from its own memory (no serialised copy)."""
    import torch

    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for k, t in tensors.items():
        nb = t.numel() * t.element_size()
        header[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nb]}
        offset += nb
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            f.write(t.contiguous().view(-1).view(torch.uint8).numpy().data)


def meta_model(arch: dict[str, Any], padded_vocab: int, dtype: Any) -> Any:
    """megatron-core's GPTModel with every parameter on the meta device: shapes and names, no memory."""
    import torch

    from snakellm.launch.runtime import ensure_single_process
    from snakellm.models.build import build_model

    ensure_single_process("cpu")
    with torch.device("meta"):
        model, _ = build_model(arch, padded_vocab, device="cpu", fused_loss="eager", use_te=False)
    return model.to(dtype)


def _group_of(name: str) -> int:
    """The layer a (possibly prefixed) parameter name belongs to; -1 outside the layers."""
    parts = name.split(".")
    for j in range(len(parts) - 2):
        if parts[j] == "decoder" and parts[j + 1] == "layers":
            return int(parts[j + 2])
    return -1


class _LayerCache:
    """The converted tensors of one group (a layer, or everything outside the layers) at a time."""

    def __init__(self, convert: Callable[[int], dict[str, Any]], dtype: Any) -> None:
        self.convert, self.dtype = convert, dtype
        self.group: int | None = None
        self.tensors: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        group = _group_of(name)
        if group != self.group:
            self.tensors = {}  # the previous layer is freed before the next is read
            self.tensors = {k: v.to(self.dtype).contiguous() for k, v in self.convert(group).items()}
            self.group = group
        if name not in self.tensors:
            raise ExportError(f"{name}: the Hugging Face checkpoint gives no tensor for it")
        return self.tensors[name]


def _planner_class() -> type:
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    class _LazyPlanner(MCoreSavePlanner):
        """Writes each meta tensor of the plan as the real one ``produce(param name)`` returns, in layer order."""

        def __init__(self, produce: Callable[[str], Any], names: dict[Any, Any], **kw: Any) -> None:
            super().__init__(**kw)
            self.produce, self.names = produce, names

        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            decoder = "decoder.layers."

            def layer(item: Any) -> int:
                idx = item.index
                return int(idx.offset[0]) if decoder in idx.fqn and idx.offset else -1

            plan.items.sort(key=layer)  # stable: each layer converted once, in file order
            return plan

        def resolve_data(self, write_item: Any) -> Any:
            obj = super().resolve_data(write_item)
            if getattr(obj, "device", None) is None or obj.device.type != "meta":
                return obj
            idx = write_item.index
            where = self.names.get((idx.fqn, tuple(idx.offset or ())))
            if where is None:
                raise ExportError(f"{idx.fqn} at {tuple(idx.offset or ())}: no parameter found for this entry")
            name, data, root = where
            full = self.produce(name)  # the parameter's tensor, contiguous, laid out as `root`
            view = full.as_strided(data.shape, data.stride(), data.storage_offset() - root.storage_offset())
            return view.reshape(obj.shape)

    return _LazyPlanner


def _lazy_strategy(produce: Callable[[str], Any], names: dict[Any, Any], file_per_tensor: bool = False) -> Any:
    """megatron-core's torch_dist save strategy, written by torch's serial writer with :func:`_planner_class`.

    ``per_thread_copy_ahead=0`` picks torch's serial loader: its overlapping one exists to copy GPU
    tensors ahead and asks for the current CUDA stream whenever a GPU is visible, which fails for these
    CPU tensors on a GPU node. ``file_per_tensor`` (``__0_<i>.distcp`` per tensor, as readable by any
    torch_dist loader): the ``.nemo`` archive moves files into its tar one by one, so the disk holds
    one copy of the weights plus one tensor instead of two copies (64 GB for an 8B model in fp32).
    """
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    planner_cls = _planner_class()

    class LazyTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            sd, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            pyt = mcore_to_pyt_state_dict(sd, False)
            writer = dcp.FileSystemWriter(
                str(checkpoint_dir), single_file_per_rank=not file_per_tensor, thread_count=1, per_thread_copy_ahead=0
            )
            planner = planner_cls(produce, names, dedup_replicated_tensors=False, flatten_state_dict=False)
            dcp.save(pyt, storage_writer=writer, planner=planner)

    return LazyTorchDistSave("torch_dist", 1)


def import_streaming(
    hf_dir: Path, arch: dict[str, Any], padded: int, dest: Path, tok: dict[str, Any], extra: dict[str, Any]
) -> None:
    """Write ``dest``'s model-only checkpoint from ``hf_dir``'s safetensors, one layer in memory at a time."""
    import torch

    from snakellm.io import checkpoint as ckpt

    reader = SafetensorsReader(hf_dir)
    dtype = reader.dtype()
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ExportError(f"{hf_dir}: weights of dtype {dtype} (float32, bfloat16 or float16 only)")

    def convert(group: int) -> dict[str, Any]:
        return group_from_hf(arch, reader, padded, group)

    model = meta_model(arch, padded, dtype)
    cache = _LayerCache(convert, dtype)
    _check_shapes(model, convert, hf_dir)
    sharded = model.sharded_state_dict()
    ckpt_dir = dest / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    config = {"model": dict(arch), "padded_vocab": int(padded), **extra}
    from snakellm.io import run_tokenizer

    tok = run_tokenizer.carry(tok, dest)  # the run carries its tokenizer (as every model-only checkpoint)
    ckpt.write_run_config(ckpt_dir, "import", config, tokenizer=tok)
    state = {"model": sharded, "iteration": 0, "checkpoint_version": 3.0}
    names = _data_names(sharded)
    ckpt.save(ckpt_dir, 0, state, rank=0, barrier=lambda: None, sharded_strategy=_lazy_strategy(cache.get, names))


def _data_names(sharded: dict[str, Any]) -> dict[tuple[str, tuple[int, ...]], tuple[str, Any, Any]]:
    """(checkpoint key, offset) -> (parameter name, its sharded tensor's data, the parameter's tensor).

    Factories (SwiGLU's two halves of ``linear_fc1``) are applied here, in place, so that every
    entry the writer meets is a plain ShardedTensor whose data is a view of the parameter's.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    roots = {k: v.data for k, v in sharded.items() if hasattr(getattr(v, "data", None), "device")}
    apply_factories(sharded)
    names: dict[tuple[str, tuple[int, ...]], tuple[str, Any, Any]] = {}

    def walk(k: str, v: Any) -> None:
        if isinstance(v, ShardedTensor):
            names[(v.key, tuple(v.global_offset))] = (k, v.data, roots[k])
        elif isinstance(v, dict):
            for x in v.values():
                walk(k, x)
        elif isinstance(v, list | tuple):
            for x in v:
                walk(k, x)

    for k, v in sharded.items():
        if k in roots:
            walk(k, v)
    return names


def _check_shapes(model: Any, convert: Callable[[int], dict[str, Any]], where: Path) -> None:
    """The first layer and the outer tensors fit the model (names and shapes), before anything is written."""
    params = dict(model.named_parameters())
    got = {**convert(-1), **convert(0)}
    want = {n for n in params if not n.startswith("decoder.layers.") or n.startswith("decoder.layers.0.")}
    missing, extra = sorted(want - set(got)), sorted(set(got) - want)
    if missing or extra:
        raise ExportError(
            f"{where}: weights do not fit the architecture (missing {missing[:4]}, unexpected {extra[:4]})"
        )
    for k, t in got.items():
        if tuple(t.shape) != tuple(params[k].shape):
            raise ExportError(
                f"{where}: {k} has shape {tuple(t.shape)}, the architecture needs {tuple(params[k].shape)}"
            )


# ----------------------------------------------------------------------------- export


def save_nemo_weights(info: dict[str, Any], weights_dir: Path, prefix: str) -> int:
    """NeMo's ``model_weights/`` (fp32, keys under ``prefix``) from our checkpoint, one layer at a time.

    Returns the number of parameters. The checkpoint's groups come in the order the lazy writer asks
    for them (outside the layers, then layer 0, 1, ...), so each is read once.
    """
    import torch

    from snakellm.export.hf import _TE_NAMES

    arch, padded = info["arch"], info["padded_vocab_size"]
    groups = read_groups(info["checkpoint_dir"], info["iteration"], arch, padded)
    seen: dict[int, dict[str, Any]] = {}

    def convert(group: int) -> dict[str, Any]:
        while group not in seen:
            g = next(groups)
            seen.clear()  # the previous group is no longer needed
            seen[_group_of(next(iter(g)))] = g
        return {prefix + k: v for k, v in seen[group].items()}

    model = meta_model(arch, padded, torch.float32)
    cache = _LayerCache(convert, torch.float32)
    sharded = model.sharded_state_dict(prefix=prefix)
    names = _data_names(sharded)
    for key, (name, data, root) in list(names.items()):
        for te, local in _TE_NAMES.items():  # the checkpoint's groups use local-spec names
            if name.endswith(te):
                names[key] = (name[: -len(te)] + local, data, root)
    from megatron.core import dist_checkpointing

    weights_dir.mkdir(parents=True)
    strategy = _lazy_strategy(cache.get, names, file_per_tensor=True)
    dist_checkpointing.save(sharded, str(weights_dir), sharded_strategy=strategy)
    return sum(p.numel() for p in model.parameters())


def layer_groups(model: Any, ssd: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    """The sharded state dict split into groups: -1 (outside the layers), then each layer."""
    groups: dict[int, dict[str, Any]] = {}
    for k, v in ssd.items():
        if k.endswith("_extra_state"):
            continue
        g = int(k.split(".")[2]) if k.startswith("decoder.layers.") else -1
        groups.setdefault(g, {})[k] = v
    yield from sorted(groups.items())


class ChunkReader:
    """Tensors of a torch_dist checkpoint read chunk by chunk, straight from its ``.distcp`` files.

    megatron-core's ``dist_checkpointing.load`` wants the whole of each layer-stacked tensor in one
    request; a layer is one chunk of it (offset ``(i, 0, ...)``), stored as its own ``torch.save``
    record whose file, offset and length the checkpoint's ``.metadata`` lists. Reading that record
    is what DCP's own reader does for it. A region stored otherwise (an FSDP run writes each rank's
    row slice of a layer as rectangular blocks, a tensor-parallel run a slice per rank) is put
    together from the chunks that overlap it.
    """

    def __init__(self, iter_dir: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.dir = iter_dir
        md = FileSystemReader(str(iter_dir)).read_metadata()
        self.storage, self.tensors = md.storage_data, md.state_dict_metadata

    def read(self, key: str, offset: tuple[int, ...], shape: tuple[int, ...] | None = None) -> Any:
        """The region of ``key`` at ``offset`` of ``shape`` (global coordinates; None: the chunk stored there)."""
        import torch

        chunks = getattr(self.tensors.get(key), "chunks", None) or []
        whole = shape is None or any(
            tuple(c.offsets) == tuple(offset) and tuple(c.sizes) == tuple(shape) for c in chunks
        )
        if whole:
            return self._record(key, offset)
        assert shape is not None
        out, covered = None, 0
        for c in chunks:
            lo = [max(a, b) for a, b in zip(offset, c.offsets)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offset, shape, c.offsets, c.sizes)]
            if any(x >= y for x, y in zip(lo, hi)):
                continue
            part = self._record(key, tuple(c.offsets)).reshape(tuple(c.sizes))
            if out is None:
                out = torch.empty(shape, dtype=part.dtype)
            dst = tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, offset))
            out[dst] = part[tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, c.offsets))]
            covered += int(torch.Size([y - x for x, y in zip(lo, hi)]).numel())
        if out is None or covered != torch.Size(shape).numel():
            raise ExportError(f"{self.dir}: the chunks of {key} do not cover {tuple(shape)} at {tuple(offset)}")
        return out

    def _record(self, key: str, offset: tuple[int, ...]) -> Any:
        import io

        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.storage.get(MetadataIndex(key, torch.Size(offset)))
        if info is None:
            raise ExportError(f"{self.dir}: no chunk {key} at {offset} in the checkpoint")
        if getattr(info, "transform_descriptors", None):
            raise ExportError(f"{self.dir}: {key} is stored with transforms {info.transform_descriptors}")
        with open(self.dir / info.relative_path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        return torch.load(io.BytesIO(raw), weights_only=True)


def _load_group(reader: ChunkReader, group: dict[str, Any]) -> dict[str, Any]:
    """The group's tensors: its sharded tensors read chunk by chunk, factories (SwiGLU halves) merged."""
    import copy

    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, apply_factories

    built = copy.copy(group)
    apply_factories(built)

    def read(sh: Any) -> Any:
        if not isinstance(sh, ShardedTensor):
            return sh
        region = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)  # a layer of a layer-stacked tensor: (1, ...)
        return reader.read(sh.key, tuple(sh.global_offset), region).reshape(sh.local_shape)

    loaded = dict_list_map_inplace(read, built)
    return {k: group[k].merge_fn(v) if isinstance(group[k], ShardedTensorFactory) else v for k, v in loaded.items()}


def read_groups(ckpt_dir: Path, iteration: int, arch: dict[str, Any], padded: int) -> Iterator[dict[str, Any]]:
    """The checkpoint's tensors (local-spec names), one group (outer, then each layer) at a time."""
    from snakellm.export.hf import _TE_NAMES
    from snakellm.io import checkpoint as ckpt

    dtype = _checkpoint_dtype(ckpt_dir, iteration)
    model = meta_model(arch, padded, dtype)
    reader = ChunkReader(ckpt_dir / ckpt.iter_name(iteration))
    for _, group in layer_groups(model, model.sharded_state_dict()):
        out = {}
        for k, t in _load_group(reader, group).items():
            for te, local in _TE_NAMES.items():
                if k.endswith(te):
                    k = k[: -len(te)] + local
            out[k] = t
        yield out


def _checkpoint_dtype(ckpt_dir: Path, iteration: int) -> Any:
    """The dtype the checkpoint's tensors were saved in (its word embeddings')."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from snakellm.io import checkpoint as ckpt

    md = FileSystemReader(str(ckpt_dir / ckpt.iter_name(iteration))).read_metadata()
    meta = md.state_dict_metadata["embedding.word_embeddings.weight"]
    return meta.properties.dtype if hasattr(meta, "properties") else torch.float32


class ShardWriter:
    """safetensors shards of at most ``max_bytes``, each written as it fills; the index at the end."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max = out, max_bytes
        self.pending: dict[str, Any] = {}
        self.size = self.total = 0
        self.parts: list[tuple[str, list[str]]] = []

    def add(self, tensors: dict[str, Any]) -> None:
        for k, t in tensors.items():
            nb = t.numel() * t.element_size()
            if self.pending and self.size + nb > self.max:
                self.flush()
            self.pending[k] = t
            self.size += nb
            self.total += nb

    def flush(self) -> None:
        if not self.pending:
            return
        name = f".part-{len(self.parts):05d}.safetensors"
        write_safetensors(self.out / name, self.pending)
        self.parts.append((name, list(self.pending)))
        self.pending, self.size = {}, 0

    def finish(self) -> list[str]:
        """Rename the parts to HF's names (``model.safetensors`` when one); write the index when several."""
        import os

        from snakellm.io.atomic import write_json

        self.flush()
        n = len(self.parts)
        if n == 1:
            os.rename(self.out / self.parts[0][0], self.out / "model.safetensors")
            return ["model.safetensors"]
        names, weight_map = [], {}
        for i, (part, keys) in enumerate(self.parts):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(self.out / part, self.out / final)
            names.append(final)
            weight_map.update({k: final for k in keys})
        write_json(
            self.out / "model.safetensors.index.json",
            {"metadata": {"total_size": self.total}, "weight_map": weight_map},
        )
        return names


def write_hf_weights(
    groups: Iterator[dict[str, Any]], arch: dict[str, Any], vocab: int, out: Path, max_bytes: int, dtype: Any
) -> tuple[list[str], str]:
    """HF safetensors shards from megatron tensor groups (outer first); returns (files, dtype name)."""
    writer = ShardWriter(out, max_bytes)
    last: dict[str, Any] = {}
    dt = ""
    for group in groups:
        if any(k.startswith("decoder.layers.") for k in group):
            tensors = group_to_hf(arch, group, vocab, int(next(iter(group)).split(".")[2]))
        else:  # the megatron tensors of this group are not kept: only what is still to be written
            both = group_to_hf(arch, group, vocab, -1)
            # embeddings first (as transformers writes them), the final norm and head after the layers
            first = {
                k: v for k, v in both.items() if "embed" in k or k.startswith(("transformer.wte", "transformer.wpe"))
            }
            last = {k: v for k, v in both.items() if k not in first}
            tensors, both = first, {}
        if dtype is not None:
            tensors = {k: v.to(dtype) for k, v in tensors.items()}
        dt = dt or str(next(iter(tensors.values())).dtype).replace("torch.", "")
        writer.add(tensors)
    if dtype is not None:
        last = {k: v.to(dtype) for k, v in last.items()}
    writer.add(last)
    return writer.finish(), dt
