"""``snakellm serve``: serve a checkpoint over HTTP (snakellm.serve.server)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from snakellm.config.settings import DefaultsHelpFormatter, add_arguments, from_namespace
from snakellm.errors import SnakellmError
from snakellm.serve.engine.settings import EngineSettings
from snakellm.serve.server import bind, build, make_server
from snakellm.serve.settings import ServeSettings


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``snakellm serve``, apart from :func:`main` so that tests and ``--help`` checks build it alone."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm serve",
        description="Serve a checkpoint over HTTP: NeMo MegatronServer's PUT /generate and OpenAI's "
        "POST /v1/completions, POST /v1/chat/completions, GET /v1/models (GET /health). CPU or GPU.",
    )
    p.add_argument("checkpoint", help="a run dir (runs/NAME), its checkpoints/ dir or one iter_NNNNNNN/ dir")
    add_arguments(p, ServeSettings)
    add_arguments(p.add_argument_group("engine (continuous batching)"), EngineSettings)
    return p


def parse_args(argv: list[str] | None) -> tuple[str, ServeSettings, EngineSettings]:
    p = build_parser()
    a = p.parse_args(argv)
    return a.checkpoint, from_namespace(ServeSettings, a), from_namespace(EngineSettings, a)


def main(argv: list[str] | None = None) -> int:
    checkpoint, s, engine = parse_args(argv)
    from snakellm.models.loading import LoadError, describe_run

    logging.basicConfig(level=logging.WARNING if s.quiet else logging.INFO, format="[%(asctime)s] %(message)s")
    try:
        info = describe_run(checkpoint, s.iteration)
    except LoadError as e:
        print(f"snakellm serve: {e}", file=sys.stderr)
        return 2
    import torch

    from snakellm.export.hf import tokenizer_from_blend
    from snakellm.serve.generate import load_generator

    if s.threads:
        torch.set_num_threads(s.threads)
    try:
        sock = bind(s.host, s.port)
    except OSError as e:
        print(f"snakellm serve: cannot listen on {s.host}:{s.port}: {e}", file=sys.stderr)
        return 2
    gen = load_generator(checkpoint, blend=s.blend, device=s.device, iteration=s.iteration)
    block = tokenizer_from_blend(s.blend) if s.blend else info["tokenizer"]
    d = Path(info["checkpoint_dir"])
    name = s.model_name or (d.parent.name if d.name == "checkpoints" else Path(checkpoint).resolve().name)
    try:
        app = build(gen, s, name, block, Path(info["run_dir"]), engine)
    except (ValueError, SnakellmError) as e:
        print(f"snakellm serve: {e}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    print(
        f"snakellm serve: {name} on http://{host}:{port} (PUT /generate, POST /v1/completions, "
        "POST /v1/chat/completions, GET /v1/models)",
        file=sys.stderr,
        flush=True,
    )
    make_server(app, s).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
