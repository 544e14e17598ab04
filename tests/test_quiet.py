"""Quiet, useful output: a step's stderr holds our lines only (snakellm.quiet), --verbose shows everything.

The steps run for real (subprocesses of the installed `snakellm`, as a user or a rule runs them) on a
small checkpoint; every stderr line must be one of ours: a ``[HH:MM:SS] ...`` line, a ``snakellm
<step>: ...`` message, a progress bar, or (serve) a log record in our format and uvicorn's access log.
"""

from __future__ import annotations

import re
import subprocess
import warnings
from pathlib import Path

import pytest
from conftest import BIN, REPO, env_with_venv
from hf_helpers import random_checkpoint, tokenizer_block

OURS = re.compile(
    r"^(\[\d\d:\d\d:\d\d\] "  # snakellm.io.log lines
    r"|\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\] "  # serve's logging format
    r"|snakellm [a-z-]+: "  # a step's own message
    r"|[\w .-]+: +\d+%\|"  # a progress bar (tqdm)
    r"|INFO: {5})"  # uvicorn (serve)
)


def foreign_lines(stderr: str) -> list[str]:
    """Lines of ``stderr`` that are not ours (progress bars redraw with \\r: each redraw is a line)."""
    return [ln for ln in re.split(r"[\r\n]+", stderr) if ln.strip() and not OURS.match(ln)]


def snakellm(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(BIN / "snakellm"), *args], cwd=cwd, env=env_with_venv(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2-style checkpoint (random weights, the GPT-2 tokenizer): runs/quiet."""
    run = tmp_path_factory.mktemp("quiet") / "runs" / "quiet"
    random_checkpoint(run, {}, tokenizer_block("gpt2-bpe"), preset="tiny")
    return run


@pytest.mark.slow
def test_generate_prints_only_our_lines_and_verbose_shows_the_libraries(run_dir: Path):
    """The bar of issue 28: `snakellm generate RUN --prompt ...` has nothing on stderr but our own lines
    (it had ten: megatron-core's Apex/Transformer Engine fallbacks, torch's ShardedTensor deprecations)."""
    args = ("generate", str(run_dir), "--prompt", "The history of", "--max-new-tokens", "4", "--greedy")
    quiet = snakellm(*args, cwd=run_dir.parent)
    assert '"completion"' in quiet.stdout
    assert foreign_lines(quiet.stderr) == [], quiet.stderr
    assert re.search(r"^\[\d\d:\d\d:\d\d\] 1 prompt, 4 new tokens in ", quiet.stderr, re.M), quiet.stderr
    loud = snakellm("--verbose", *args, cwd=run_dir.parent)
    assert loud.stdout == quiet.stdout  # the same answer (greedy), only the noise differs
    assert "Transformer Engine and Apex are not installed" in loud.stderr, loud.stderr
    assert len(foreign_lines(loud.stderr)) >= 4, loud.stderr


@pytest.mark.slow
def test_export_train_and_serve_print_only_our_lines(run_dir: Path, tmp_path: Path):
    """export-hf, export-nemo and a short train run: stderr is ours only; serve: our lines and uvicorn's."""
    for args in (
        ("export-hf", str(run_dir), str(tmp_path / "hf")),
        ("export-nemo", str(run_dir), str(tmp_path / "quiet.nemo")),
    ):
        proc = snakellm(*args, cwd=tmp_path)
        assert foreign_lines(proc.stderr) == [], (args[0], proc.stderr)
    blend = _tiny_blend(tmp_path)
    train = snakellm(
        *("train", "--blend", str(blend), "--run-dir", str(tmp_path / "runs" / "t"), "--preset", "tiny"),
        *("--steps", "2", "--micro-batch-size", "1", "--global-batch-size", "1", "--seq-length", "32"),
        *("--save-interval", "2", "--eval-interval", "2", "--eval-iters", "1", "--split", "80,20,0"),
        cwd=tmp_path,
    )
    assert "run t:" in train.stderr and foreign_lines(train.stderr) == [], train.stderr

    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [str(BIN / "snakellm"), "serve", str(run_dir), "--port", str(port)],
        env=env_with_venv(),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert server.poll() is None, server.stderr.read() if server.stderr else ""
                time.sleep(0.2)
    finally:
        server.terminate()
        _, err = server.communicate(timeout=60)
    assert "snakellm serve: quiet on http://" in err and foreign_lines(err) == [], err


def _tiny_blend(root: Path) -> Path:
    """The shipped Botchan text tokenized with GPT-2 BPE by the real steps: a blend.json to train on."""
    jsonl = root / "botchan.jsonl"
    jsonl.write_bytes((REPO / "resources" / "corpus" / "botchan" / "botchan.jsonl").read_bytes())
    gpt2 = REPO / "resources" / "tokenizers" / "gpt2"
    prefix = root / "tokens" / "botchan_text_document"
    tok = ("--kind", "gpt2-bpe", "--vocab-file", str(gpt2 / "vocab.json"), "--merges-file", str(gpt2 / "merges.txt"))
    snakellm("tokenize", str(jsonl), str(prefix), *tok, "--source", "botchan", "--no-progress", cwd=root)
    snakellm("blend", f"{prefix}.stats.json", "--output", str(root / "blend.json"), "--weight", "botchan=1", cwd=root)
    return root / "blend.json"


def test_install_silences_library_noise_only():
    """The filters match a library's fallback notice and deprecations, never a warning raised by our code."""
    from snakellm import quiet

    def warn_from(module: str, message: str, category: type[Warning] = UserWarning) -> list[str]:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            quiet.install()
            exec(
                compile("import warnings\nwarnings.warn(m, c)", module, "exec"),
                {"__name__": module, "m": message, "c": category},
            )
        return [str(w.message) for w in got]

    assert warn_from("megatron.core.optimizer", "Transformer Engine and Apex are not installed. Falling back") == []
    assert (
        warn_from("torch.distributed.checkpoint.planner_helpers", "we are deprecating ShardedTensor", FutureWarning)
        == []
    )
    assert warn_from("snakellm.train.loop", "Transformer Engine and Apex are not installed") != []
    assert warn_from("megatron.core.models", "lr is too high for this batch size") != []


def test_verbose_environment_keeps_every_warning(monkeypatch: pytest.MonkeyPatch):
    from snakellm import quiet

    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        quiet.install()
        exec(
            compile("import warnings\nwarnings.warn('Apex is not installed')", "megatron.core.x", "exec"),
            {"__name__": "megatron.core.x"},
        )
    assert [str(w.message) for w in got] == ["Apex is not installed"]


def test_library_log_noise_is_dropped_and_a_per_document_notice_shown_once(caplog: pytest.LogCaptureFixture):
    """torchao's CUDA kernels a CPU cannot load and deprecations go; lm-eval's truncation notice (one per
    document) is shown once; any other library warning and every record of ours stay."""
    import logging

    from snakellm import quiet

    quiet.install()
    kept: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record.getMessage())

    handler = Keep()
    handler.addFilter(quiet._DropNoise())  # a handler's filter after the logger's: one verdict per record
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
        logging.getLogger("torch.utils._pytree").warning("register_constant() on Enum subclasses is deprecated")
        hf = logging.getLogger("lm_eval.models.huggingface")
        for n in (222, 190, 188):
            hf.warning("Combined length of context (%d) and continuation (5) exceeds model's maximum length (128).", n)
        logging.getLogger("some.library").warning("disk almost full")
        logging.getLogger("snakellm.serve").warning("Transformer Engine and Apex are not installed (ours: kept)")
    finally:
        root.removeHandler(handler)
    assert kept[0].startswith("Combined length of context (222)") and kept[0].endswith(
        "(once; later ones like it not shown)"
    )
    assert kept[1:] == ["disk almost full", "Transformer Engine and Apex are not installed (ours: kept)"]
