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


# A row-group slice of a parquet file, as a shard list holds it: the path, a NUL (which no file name can hold,
# so no path is ever taken for a slice) and the half-open range of row groups.
_SLICE = "\0row_groups="
DIR_SUFFIXES = {"parquet": (".parquet",), "arrow": (".arrow",)}  # a directory given for these: its files so named


def make_slice(path: str, first: int, end: int) -> str:
    """The shard-list entry for row groups ``first`` .. ``end - 1`` of the parquet file ``path``."""
    return f"{path}{_SLICE}{first}-{end}"


def split_slice(entry: str) -> tuple[str, tuple[int, int] | None]:
    """A shard-list entry's file and row-group range (None: the whole file)."""
    path, sep, rng = entry.partition(_SLICE)
    if not sep:
        return entry, None
    a, _, b = rng.partition("-")
    return path, (int(a), int(b))


def describe(entry: str) -> str:
    """A shard-list entry as a message names it: the file, and its row groups where it is a slice."""
    path, rg = split_slice(entry)
    return display(path) if rg is None else f"{display(path)} (row groups {rg[0]}..{rg[1] - 1})"


def list_source_files(spec: dict, base: str | os.PathLike = ".") -> list[str]:
    """A local source's files: the glob hits, a directory standing for its files of a columnar format."""
    pats = spec["path"] if isinstance(spec["path"], list) else [spec["path"]]
    suffixes = DIR_SUFFIXES.get(spec.get("format", ""))
    if not suffixes:
        return list_local_shards(pats, base)
    found: set[str] = set(list_local_shards(pats, base))
    for pat in pats:
        full = pat if os.path.isabs(pat) else os.path.join(base, pat)
        for hit in glob.iglob(full, recursive=True):
            if not os.path.isdir(hit):
                continue
            for root, _dirs, files in os.walk(hit):
                for f in files:
                    if f.endswith(suffixes):
                        p = os.path.join(root, f)
                        found.add(p if os.path.isabs(pat) else os.path.relpath(p, base))
    return natural_sorted(found)


FOOTERS = "footers.json"  # the footer cache of a source planned by row group, in its plan directory


def _footer_row_groups(path: str) -> int | None:
    """The row-group count a parquet file's footer gives (None: no readable footer; its chunk job says why)."""
    import pyarrow.parquet as pq  # only sources planned by row group pay for it

    try:
        return int(pq.read_metadata(path).num_row_groups)
    except (OSError, ValueError, Exception):  # pyarrow's ArrowInvalid is a ValueError; be broad: parse time
        return None


def row_group_counts(files: list[str], cache: str | os.PathLike | None = None) -> dict[str, int | None]:
    """Each parquet file's row-group count, from its footer or from ``cache`` (path -> [size, mtime_ns, inode,
    ctime_ns, count]) where the file's stat is the one recorded; the cache is rewritten only when it changed.

    10,000 footers take seconds to read; the stats of unchanged files take a fraction of one.
    """
    old: dict[str, Any] = {}
    if cache is not None:
        try:
            with open(cache, "rb") as fh:
                old = json.load(fh)
        except (OSError, ValueError):
            old = {}
    new: dict[str, list[int]] = {}
    out: dict[str, int | None] = {}
    for f in files:
        try:
            st = os.stat(f)
        except OSError:
            out[f] = None
            continue
        ident = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
        rec = old.get(f)
        if isinstance(rec, list) and rec[:4] == ident:
            n = rec[4]
        else:
            n = _footer_row_groups(f)
        out[f] = n
        if n is not None:  # a file without a footer is read again next time (it may be complete by then)
            new[f] = [*ident, n]
    if cache is not None and new != old:
        cache = Path(cache)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(new, separators=(",", ":")), encoding="utf-8")
        os.replace(tmp, cache)
    return out


def slice_row_groups(counts: dict[str, int | None], per_chunk: int) -> list[list[str]]:
    """One chunk per ``per_chunk`` row groups of each file, in file order; never two files in one chunk.

    A file with no readable footer (cut short, not parquet) is one chunk of the whole file: its job quarantines it
    as ``unreadable_file``. A file of no row groups is one chunk of none (it is read and has no rows).
    """
    if per_chunk < 1:
        raise ValueError("row_groups_per_chunk must be >= 1")
    chunks: list[list[str]] = []
    for f, n in counts.items():
        if n is None:
            chunks.append([f])
            continue
        for a in range(0, max(n, 1), per_chunk):
            chunks.append([make_slice(f, a, min(a + per_chunk, n))])
    return chunks


def plan_source(
    spec: dict, base: str | os.PathLike = ".", cache_dir: str | os.PathLike | None = None
) -> dict[str, list[str]]:
    """``{chunk_name: [shard, ...]}`` for one source config entry, in chunk order.

    ``cache_dir``: where a source planned by row group keeps its footer cache (the workflow's data/plan/{source}).
    """
    kind = spec["kind"]
    if kind == "local":
        shards = list_source_files(spec, base)
    elif kind == "http":
        shards = list_http_shards(spec)
    else:  # the schema rejects this earlier; keep the message for direct callers
        raise ValueError(f"unknown source kind {kind!r}")
    if spec.get("row_groups_per_chunk"):
        if kind != "local":
            raise ValueError("row_groups_per_chunk needs local parquet files (http: use shards_per_chunk)")
        full = shards if os.path.abspath(base) == os.getcwd() else [os.path.join(base, s) for s in shards]
        counts = row_group_counts(full, None if cache_dir is None else Path(cache_dir) / FOOTERS)
        chunks = slice_row_groups(dict(zip(shards, counts.values(), strict=True)), int(spec["row_groups_per_chunk"]))
    else:
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
    by_path = {
        (r.get("shard"), tuple(r["row_groups"]) if r.get("row_groups") else None): r
        for r in recorded
        if isinstance(r, dict)
    }
    for entry in shards:
        s, units = split_slice(entry)
        rec = by_path.get((s, units)) or {}
        was = rec.get("stat")
        if was is None:
            continue
        try:
            now = shard_identity(os.stat(s))
        except OSError as e:
            return f"shard {display(s)}: {e.strerror}"
        digest = rec.get("digest") or rec.get("sha256")
        if now != was and not _same_content_moved(s, now, was, digest, units):
            diff = ", ".join(f"{k} {was.get(k)} -> {v}" for k, v in now.items() if was.get(k) != v)
            return f"shard {describe(entry)} changed since its chunk was built ({diff})"
    return None


def _same_content_moved(
    shard: str, now: dict[str, int], was: dict[str, Any], sha256: Any, units: tuple[int, int] | None = None
) -> bool:
    """A shard whose size and mtime are as recorded but whose inode/ctime are not: the same bytes, copied?

    A workspace copied or moved with its timestamps (``cp -a``, ``rsync -a``,
    ``shutil.copytree``) gives every shard a new inode and ctime. Only then is
    the shard read, and its sha256 (recorded by the chunk job while it read the
    shard) decides: equal bytes are the same input, so nothing reruns; a
    same-size, same-mtime replacement with other bytes still reruns its chunk.
    """
    if not isinstance(sha256, str) or any(now[k] != was.get(k) for k in ("size", "mtime_ns")):
        return False
    if sha256.startswith("xxh3_128:"):  # a parquet/Arrow file (or a slice: its row groups and the footer)
        from snakellm.data.columnar import content_digest

        try:
            return content_digest(shard, units) == sha256
        except Exception:  # not parquet any more, or cut short: not the same content
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
