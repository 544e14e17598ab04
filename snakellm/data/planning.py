"""Chunk planning: which shards belong to which chunk.

A source's shards are listed (a local glob, or http URLs expanded from a
template), put in natural order ("example_train_2" before "example_train_10")
and sliced into runs of ``shards_per_chunk``. Appending shards that sort last
therefore only changes the last chunk; every earlier chunk keeps its inputs and
is not rebuilt. Jobs are per chunk, never per shard: 60,000 shards stay ~75 jobs.

Everything here runs at Snakefile parse time, so it must stay fast for 10^5 shards.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from snakellm.io.readers import display

_NUM = re.compile(r"(\d+)")
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$")


def chunk_name(index: int) -> str:
    """The stable name of the ``index``-th chunk of a source."""
    return f"chunk-{index:05d}"


def natural_key(s: str) -> tuple:
    """Sort key that orders embedded numbers numerically."""
    parts = _NUM.split(s)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts))


def natural_sorted(items) -> list[str]:
    return sorted(items, key=natural_key)


def _expand_group(body: str, template: str) -> list[str]:
    m = _RANGE.match(body)
    if m:
        a, b = m.group(1), m.group(2)
        step = abs(int(m.group(3) or 1)) or 1
        lo, hi = int(a), int(b)
        width = max(len(a), len(b)) if (a.startswith("0") and len(a) > 1) or (b.startswith("0") and len(b) > 1) else 0
        rng = range(lo, hi + 1, step) if lo <= hi else range(lo, hi - 1, -step)
        return [str(i).zfill(width) if width else str(i) for i in rng]
    if "," in body:
        return body.split(",")
    raise ValueError(f"bad brace group {{{body}}} in {template!r}: use {{a..b}} or {{x,y,z}}")


def expand_braces(template: str) -> list[str]:
    """Shell-style brace expansion: ``chunk{1..2}/x_{0..1}`` -> 4 strings, in order.

    Supports numeric ranges (``{0..5999}``, zero padded ``{000..099}``, a step
    ``{0..10..2}``) and lists (``{train,valid}``). Groups are not nested.
    """
    pieces = _BRACE.split(template)
    literals = pieces[0::2]
    groups = [_expand_group(b, template) for b in pieces[1::2]]
    if not groups:
        return [template]
    out = []
    for combo in itertools.product(*groups):
        s = [literals[0]]
        for value, lit in zip(combo, literals[1:]):
            s.append(value)
            s.append(lit)
        out.append("".join(s))
    return out


def list_local_shards(patterns: str | list[str], base: str | os.PathLike = ".") -> list[str]:
    """All files matching the glob(s), relative to ``base`` if the pattern was, naturally sorted."""
    if isinstance(patterns, str):
        patterns = [patterns]
    found: set[str] = set()
    for pat in patterns:
        full = pat if os.path.isabs(pat) else os.path.join(base, pat)
        for hit in glob.iglob(full, recursive=True):
            if os.path.isdir(hit):
                continue
            found.add(hit if os.path.isabs(pat) else os.path.relpath(hit, base))
    return natural_sorted(found)


def list_http_shards(spec: dict) -> list[str]:
    """URLs of an http source: ``url`` (a brace template or a list of them) and/or ``urls``."""
    urls: list[str] = []
    templates = spec.get("url") or []
    if isinstance(templates, str):
        templates = [templates]
    for t in templates:
        urls.extend(expand_braces(t))
    urls.extend(spec.get("urls") or [])
    unique = list(dict.fromkeys(urls))  # first occurrence wins, order kept
    return natural_sorted(unique)


def url_to_relpath(url: str) -> str:
    """Where a downloaded shard lives under ``data/raw/{source}/shards/``.

    Derived from the URL alone (host + path), so re-planning chunks never renames
    or re-downloads a shard. A query string gets a short hash suffix.
    """
    parts = urlsplit(url)
    path = parts.path.lstrip("/") or "index"
    rel = f"{parts.netloc.replace(':', '_')}/{path}"
    if parts.query:
        rel += "." + hashlib.sha256(parts.query.encode()).hexdigest()[:12]
    rel = os.path.normpath(rel)
    if rel.startswith("..") or os.path.isabs(rel):
        raise ValueError(f"unsafe URL path in {url!r}")
    return rel


def slice_chunks(shards: list[str], shards_per_chunk: int) -> list[list[str]]:
    """Consecutive runs of ``shards_per_chunk`` shards (the last one may be shorter)."""
    if shards_per_chunk < 1:
        raise ValueError("shards_per_chunk must be >= 1")
    return [shards[i : i + shards_per_chunk] for i in range(0, len(shards), shards_per_chunk)]


def plan_source(spec: dict, base: str | os.PathLike = ".") -> dict[str, list[str]]:
    """``{chunk_name: [shard, ...]}`` for one source config entry, in chunk order."""
    kind = spec["kind"]
    if kind == "local":
        shards = list_local_shards(spec["path"], base)
    elif kind == "http":
        shards = list_http_shards(spec)
    else:  # the schema rejects this earlier; keep the message for direct callers
        raise ValueError(f"unknown source kind {kind!r}")
    chunks = slice_chunks(shards, int(spec["shards_per_chunk"]))
    return {chunk_name(i): c for i, c in enumerate(chunks)}


LIST_HEADER = "# snakellm shard list: one JSON string per line; lines starting with # are notes\n"


def encode_shard_list(shards: list[str]) -> str:
    """The body of a shard list: one JSON string per line, ASCII only.

    Every path line starts with ``"``, so none can be taken for a ``#`` note, a
    newline in a name is ``\\n`` inside its string, and a byte that is not UTF-8
    (a surrogate, as ``os.fsdecode`` gives it) is a ``\\udcXX`` escape that
    :func:`read_shard_list` turns back into the same name.
    """
    dumps = json.dumps
    return "".join(dumps(s) + "\n" for s in shards)


def read_shard_list(path: str | os.PathLike) -> list[str]:
    """The paths in a shard list file (see :func:`encode_shard_list`), in order.

    Blank lines and ``#`` notes are skipped. A line that is not a JSON string
    is taken as a path verbatim, so a hand-written list of plain paths works
    too (a hand-written path that starts with ``"`` or ``#``, or holds a
    newline, must be written as a JSON string).
    """
    out: list[str] = []
    with open(path, encoding="utf-8", newline="\n") as fh:
        for i, line in enumerate(fh, start=1):
            line = line.rstrip("\n")
            if not line.strip() or line.startswith("#"):
                continue
            if line.startswith('"'):
                try:
                    item = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}, line {i}: not a JSON string: {e}") from None
                if not isinstance(item, str):
                    raise ValueError(f"{path}, line {i}: not a JSON string")
                out.append(item)
            else:
                out.append(line)
    return out


def write_shard_list(path: str | os.PathLike, shards: list[str], note: str | None = None) -> Path:
    """Write a chunk's shard list unless the file already holds exactly that list.

    The workflow hands shard lists to ``snakellm download``/``snakellm chunk``
    in these files instead of on the command line: Linux caps one argument at
    128 KiB, about 1,500 SlimPajama URLs. Rewriting only on a change keeps the
    file as it is, so an unchanged chunk is never rebuilt because of it, and a
    changed list (a shard appended, a new ``shards_per_chunk``) reruns exactly
    the chunks whose list changed. ``note`` forces a rewrite with the note as a
    ``#`` line: the content changes, so the job that reads the list runs again
    (Snakemake ignores a newer mtime when a small file's checksum is the same),
    and the note stays until the list itself changes. The format
    (:func:`encode_shard_list`) holds any name a filesystem allows.
    """
    path = Path(path)
    body = encode_shard_list(shards)
    try:
        with open(path, encoding="utf-8", newline="\n") as fh:
            old = fh.read()
        if note is None and "".join(ln for ln in old.splitlines(True) if not ln.startswith("#")) == body:
            return path
    except (OSError, UnicodeDecodeError):
        pass
    notes = "".join(f"# {ln}\n" for ln in (note or "").splitlines())
    text = LIST_HEADER + notes + body
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="ascii", newline="\n")
    os.replace(tmp, path)
    return path


def shard_identity(st: os.stat_result) -> dict[str, int]:
    """What a chunk records of each local shard, from one stat: a change of any of them reruns the chunk.

    mtime alone misses a file replaced by one with an older mtime (``cp -p``,
    ``rsync -a``, ``tar x``, ``mv`` of an older file): the replacement has a
    new inode and a new ctime, which no tool can set back.
    """
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def stale_local_chunk(stats: str | os.PathLike, shards: list[str]) -> str | None:
    """Why a local chunk's output no longer matches its shards (None: it does, or it was never built).

    Compares what the chunk job recorded for every shard (size, mtime_ns,
    ctime_ns, inode; see :func:`shard_identity`) in ``{chunk}.stats.json``
    with a stat of the shard now: no shard is read, so 60,000 shards cost
    60,000 stats at every start. A list that changed reruns the chunk anyway
    (the list file differs); only shards recorded under the same path are compared.
    """
    try:
        with open(stats, "rb") as fh:
            recorded = json.load(fh).get("per_shard") or []
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as e:
        return f"{stats} is unreadable ({e})"
    by_path = {r.get("shard"): r for r in recorded if isinstance(r, dict)}
    for s in shards:
        rec = by_path.get(s) or {}
        was = rec.get("stat")
        if was is None:
            continue
        try:
            now = shard_identity(os.stat(s))
        except OSError as e:
            return f"shard {display(s)}: {e.strerror}"
        if now != was and not _same_content_moved(s, now, was, rec.get("sha256")):
            diff = ", ".join(f"{k} {was.get(k)} -> {v}" for k, v in now.items() if was.get(k) != v)
            return f"shard {display(s)} changed since its chunk was built ({diff})"
    return None


def _same_content_moved(shard: str, now: dict[str, int], was: dict[str, Any], sha256: Any) -> bool:
    """A shard whose size and mtime are as recorded but whose inode/ctime are not: the same bytes, copied?

    A workspace copied or moved with its timestamps (``cp -a``, ``rsync -a``,
    ``shutil.copytree``) gives every shard a new inode and ctime. Only then is
    the shard read, and its sha256 (recorded by the chunk job while it read the
    shard) decides: equal bytes are the same input, so nothing reruns; a
    same-size, same-mtime replacement with other bytes still reruns its chunk.
    """
    if not isinstance(sha256, str) or any(now[k] != was.get(k) for k in ("size", "mtime_ns")):
        return False
    h = hashlib.sha256()
    try:
        with open(shard, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    except OSError:
        return False
    return h.hexdigest() == sha256


def stale_manifest(manifest: str | os.PathLike) -> str | None:
    """Why a chunk's download manifest no longer describes the files on disk (None: it does, or it does not exist).

    A shard deleted by hand, or one whose size differs from what was recorded
    (a copy cut short, a file edited), makes the manifest stale: the workflow
    then runs that chunk's download again, which fetches only what is missing
    (``snakellm chunk`` removes a shard whose sha256 does not match, so that
    case ends here too). Only sizes are compared: a stat per shard keeps this
    cheap enough for 60,000 shards at every start.
    """
    manifest = Path(manifest)
    try:
        with open(manifest) as fh:
            shards = json.load(fh)["shards"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable ({e})"
    base = manifest.parent
    for s in shards:
        p = base / s["path"]
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            return f"shard {p} ({s.get('url', '')}) is missing"
        if size != s.get("size"):
            return f"shard {p} is {size} bytes, the manifest recorded {s.get('size')}"
    return None
