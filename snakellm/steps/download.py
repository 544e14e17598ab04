"""``snakellm download``: fetch a chunk's http shards (snakellm.data.download) with the ``download`` settings."""

from __future__ import annotations

import argparse
import os
import sys

from snakellm.config.sections import DownloadSettings
from snakellm.config.settings import DefaultsHelpFormatter, add_arguments
from snakellm.data.download import HELP, DownloadError, Options, download_chunk
from snakellm.data.planning import read_shard_list


class _Formatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown as in every step, and HELP's own line breaks kept (it is a list of rules)."""


def build_parser() -> argparse.ArgumentParser:
    """The `snakellm download` flags (settings from snakellm.config.sections, with the config's defaults)."""
    p = argparse.ArgumentParser(
        prog="snakellm download",
        description=HELP,
        formatter_class=_Formatter,
    )
    p.add_argument("urls", nargs="*", metavar="URL", help="shard URLs, in chunk order")
    p.add_argument(
        "--url-file",
        help="read more URLs from this file (a shard list as the planner writes it: one JSON string per line, "
        "# notes; plain lines work too); for very long lists",
    )
    p.add_argument("--dest", required=True, help="directory the shards are stored under (data/raw/{source}/shards)")
    p.add_argument(
        "--manifest",
        required=True,
        help="the chunk's manifest JSON, written last (data/raw/{source}/{chunk}.manifest.json)",
    )
    p.add_argument("--source", default="", help="source name, recorded in the manifest")
    p.add_argument("--chunk", default="", help="chunk name, recorded in the manifest")
    add_arguments(p.add_argument_group("download (config: download)"), DownloadSettings)
    p.add_argument(
        "--format",
        default="",
        help="the source's format (jsonl.zst, mediawiki, ...): with each URL's suffix, the compression its body "
        "must have; an HTML/text body or Content-Type for a compressed shard is retried, then fails",
    )
    p.add_argument(
        "--token-env",
        default="",
        metavar="VAR",
        help="environment variable holding a bearer token (HF_TOKEN for a gated Hub dataset): sent as "
        "`Authorization: Bearer ...` to each URL's own host only, never to the host a redirect leads to, and never "
        "written to a log, the manifest or an error (config: sources.NAME.token_env)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    urls = list(a.urls)
    if a.url_file:
        try:
            urls += [u.strip() for u in read_shard_list(a.url_file)]
        except (OSError, ValueError) as e:
            p.error(f"cannot read --url-file: {e}")
    if not urls:
        p.error("no URLs given")
    if a.concurrency < 1 or min(a.retries, a.backoff, a.max_backoff, a.deadline, a.min_rate) < 0 or a.timeout <= 0:
        p.error(
            "--concurrency must be >= 1, --retries/--backoff/--max-backoff/--deadline/--min-rate >= 0 and --timeout > 0"
        )
    opts = Options(
        a.concurrency, a.retries, a.backoff, a.max_backoff, a.timeout, a.deadline, a.min_rate, a.format, a.token_env
    )
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
