"""``snakellm download``: fetch a chunk's http shards (snakellm.data.download) with the ``download`` settings."""

from __future__ import annotations

import argparse
import os
import sys

from snakellm.config.sections import DownloadSettings
from snakellm.config.settings import add_arguments
from snakellm.data.download import HELP, DownloadError, Options, download_chunk


def build_parser() -> argparse.ArgumentParser:
    """The `snakellm download` flags (settings from snakellm.config.sections, with the config's defaults)."""
    p = argparse.ArgumentParser(
        prog="snakellm download",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("urls", nargs="*", metavar="URL", help="shard URLs, in chunk order")
    p.add_argument("--url-file", help="read more URLs from this file (one per line; for very long lists)")
    p.add_argument("--dest", required=True, help="directory the shards are stored under (data/raw/{source}/shards)")
    p.add_argument(
        "--manifest",
        required=True,
        help="the chunk's manifest JSON, written last (data/raw/{source}/{chunk}.manifest.json)",
    )
    p.add_argument("--source", default="", help="source name, recorded in the manifest")
    p.add_argument("--chunk", default="", help="chunk name, recorded in the manifest")
    add_arguments(p.add_argument_group("download (config: download)"), DownloadSettings)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    urls = list(a.urls)
    if a.url_file:
        with open(a.url_file) as fh:
            urls += [line.strip() for line in fh if line.strip() and not line.lstrip().startswith("#")]
    if not urls:
        p.error("no URLs given")
    if a.concurrency < 1 or a.retries < 0 or a.backoff < 0 or a.max_backoff < 0 or a.timeout <= 0:
        p.error("--concurrency must be >= 1, --retries/--backoff/--max-backoff >= 0 and --timeout > 0")
    opts = Options(a.concurrency, a.retries, a.backoff, a.max_backoff, a.timeout)
    try:
        man = download_chunk(
            urls, a.dest, a.manifest, opts=opts, source=a.source, chunk=a.chunk, show_progress=not a.no_progress
        )
    except (DownloadError, ValueError) as e:
        print(f"snakellm download: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("snakellm download: interrupted; partial files kept for the next run", file=sys.stderr, flush=True)
        # Do not wait up to --timeout for worker threads blocked in a read. Exiting
        # now is as safe as SIGKILL: a .part always holds a prefix of the body,
        # and the next run hashes it from disk before resuming.
        os._exit(130)
    s = man["_stats"]
    print(
        f"{a.manifest}: {len(man['shards'])} shards, {man['size'] / 1e6:.1f} MB "
        f"({s['fetched_bytes'] / 1e6:.1f} MB fetched in {s['requests']} requests, {s['reused']} shards already complete) "
        f"in {s['seconds']:.1f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
