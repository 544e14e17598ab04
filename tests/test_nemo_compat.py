"""Our `.nemo` files read by NeMo's own code, and NeMo's `.nemo` files read by us.

NeMo 2.4.1 (the last release with NeMo-1's MegatronGPTModel) runs in its own venv,
.nemo-venv/, which scripts/setup-nemo-env.sh creates (once; a few minutes) from the
session fixture. tests/nemo_probe.py runs there as a subprocess: ``MegatronGPTModel.restore_from``
on our file, then NeMo's ``save_to`` of a perturbed copy. The probe's environment shims
(no CUDA, apex or Transformer Engine; NeMo 2.4.1 on megatron-core 0.16; no network) are
listed with their reasons in its docstring, (a)-(i); none changes how the file is read.

Per style: GPT-2 (LayerNorm, GeLU, learned positions, tied, biases) with the GPT-2 BPE
tokenizer, and Llama (RMSNorm, SwiGLU, RoPE base 50000, grouped-query attention, untied)
with a SentencePiece tokenizer. Checked: every tensor NeMo built is torch.equal to ours,
NeMo's logits on a batch match ours (max |diff| < 1e-5: NeMo's local spec computes attention
unfused, ours with SDPA: same math, float rounding only), NeMo's tokenizer gives our ids,
and NeMo's ``save_to`` output imports with `snakellm import-nemo` to identical tensors.
Runtime: ~2 min on 2 cores (every style's steps in one process a side), plus the one-time venv setup.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO, env_with_venv

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
GPT2_DIR = REPO / "resources" / "tokenizers" / "gpt2"
TEXT = "The quick brown fox jumps over the lazy dog. Botchan went to Shikoku to teach mathematics."

CASES = {
    "gpt2": dict(style="gpt2", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=64),
    "llama": dict(
        style="llama",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=176,
        seq_length=64,
        rotary_base=50000,
    ),
    # the families of tests/test_hf_families.py: Llama 3.x RoPE scaling (a short original context, so every
    # branch of the formula is taken), Qwen2's q/k/v-only biases with tied embeddings, Mistral's window
    "llama3": dict(
        style="llama3",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=176,
        seq_length=64,
        rotary_base=500000,
        rope_scaling_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_positions=16,
    ),
    "qwen2": dict(
        style="qwen2",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=176,
        seq_length=64,
        rotary_base=1000000,
        qkv_bias=True,
        tie_embeddings=True,
    ),
    "mistral": dict(
        style="mistral",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=176,
        seq_length=64,
        sliding_window=64,
    ),
}
# tensors per case: gpt2 2 layers x 12 (+ biases, LayerNorm biases) + 4; llama 2 x 6 + embedding, output, final norm
TENSORS = {"gpt2": 28, "llama": 15, "llama3": 15, "qwen2": 16, "mistral": 15}


def run(cmd: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = env_with_venv()
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="session")
def nemo_python() -> Path:
    """NeMo 2.4.1's interpreter (.nemo-venv/, created by scripts/setup-nemo-env.sh on first use)."""
    subprocess.run(["bash", str(REPO / "scripts" / "setup-nemo-env.sh")], check=True, timeout=3600)
    return REPO / ".nemo-venv" / "bin" / "python"


def _spm_model(root: Path) -> Path:
    """A small SentencePiece BPE model trained on the shipped Botchan text (~1 s)."""
    import sentencepiece as spm

    texts = []
    for f in sorted((REPO / "resources" / "corpus" / "botchan").glob("*.jsonl")):
        texts += [json.loads(line)["text"] for line in f.read_text().splitlines() if line.strip()]
    corpus = root / "botchan.txt"
    corpus.write_text("\n".join(texts))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(root / "tokenizer"),
        vocab_size=500,
        model_type="bpe",
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    return root / "tokenizer.model"


def _tokenizer(style: str, root: Path) -> dict:
    from snakellm.tokenize import encoders

    if style == "gpt2":
        tok = encoders.load(
            "gpt2-bpe", vocab_file=str(GPT2_DIR / "vocab.json"), merges_file=str(GPT2_DIR / "merges.txt")
        )
    else:
        tok = encoders.load("sentencepiece", model_file=str(_spm_model(root)))
    return tok.info()


@pytest.fixture(scope="module")
def roundtrips(nemo_python: Path, tmp_path_factory) -> dict[str, dict]:
    """Every style: our checkpoint -> export-nemo -> NeMo restore_from (+ save_to) -> import-nemo, all artefacts
    kept. Each side runs once for all styles (our steps in one process of tests/nemo_helpers.py, NeMo's in one
    process of tests/nemo_probe.py): a process a step cost ~10 s of imports each, 65 s a style."""
    import torch

    from snakellm.tokenize import encoders

    out: dict[str, dict] = {}
    for style in sorted(CASES):
        root = tmp_path_factory.mktemp(f"nemo-{style}")
        tok = _tokenizer(CASES[style]["style"], root)
        (root / "arch.json").write_text(json.dumps(CASES[style]))
        (root / "tok.json").write_text(json.dumps(tok))
        t = encoders.load(tok["kind"], **{k: v for k, v in tok["files"].items()})
        ids = t.encode(TEXT)
        torch.save(torch.tensor([ids[:24], ids[-24:]]), root / "batch.pt")
        out[style] = {"style": style, "root": root, "tok": tok, "ids": ids}
    work = tmp_path_factory.mktemp("nemo-steps")

    def ours(name: str, steps: list[list[str]]) -> None:
        (work / f"{name}.json").write_text(json.dumps(steps))
        run([sys.executable, str(REPO / "tests" / "nemo_helpers.py"), "steps", f"{name}.json"], work)

    roots = {style: str(r["root"]) for style, r in out.items()}
    ours(
        "export",
        [
            step
            for style, root in roots.items()
            for step in (
                [root, "make", "runs/ours", "arch.json", "tok.json", "7"],
                [root, "snakellm", "export-nemo", "runs/ours", f"out/{style}.nemo", "--threads", "1"],
            )
        ],
    )
    jobs = [
        {
            "nemo": f"{root}/out/{style}.nemo",
            "batch": f"{root}/batch.pt",
            "out_dir": f"{root}/nemo",
            "resave": f"{root}/out/{style}-nemo-saved.nemo",
            "seed": 3,
        }
        for style, root in roots.items()
    ]
    (work / "jobs.json").write_text(json.dumps(jobs))
    run([str(nemo_python), str(REPO / "tests" / "nemo_probe.py"), "--jobs", "jobs.json"], work, timeout=1800)
    ours(
        "import",
        [
            step
            for style, root in roots.items()
            for step in (
                [root, "dump", "runs/ours", "batch.pt", "ours"],
                [root, "snakellm", "import-nemo", f"out/{style}-nemo-saved.nemo", "runs/imported"],
                [root, "dump", "runs/imported", "batch.pt", "imported"],
            )
        ],
    )
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def roundtrip(request, roundtrips: dict[str, dict]) -> dict:
    return roundtrips[request.param]


def _load(path: Path):
    import torch

    return torch.load(path, weights_only=True)


def test_nemo_restore_from_has_our_tensors_and_logits(roundtrip):
    import torch

    r = roundtrip["root"]
    ours, theirs = _load(r / "ours" / "state.pt"), _load(r / "nemo" / "state.pt")
    assert sorted(ours) == sorted(theirs)
    assert len(ours) == TENSORS[roundtrip["style"]]
    unequal = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not unequal, f"tensors differ after NeMo's restore_from: {unequal}"
    lo, ln = _load(r / "ours" / "logits.pt"), _load(r / "nemo" / "logits.pt")
    assert lo.shape == ln.shape
    assert (lo - ln).abs().max().item() < 1e-5
    assert torch.equal(lo.argmax(-1), ln.argmax(-1))


def test_nemo_tokenizer_and_config(roundtrip):
    """NeMo rebuilt the same tokenizer from the packed artifacts and the same architecture from the yaml."""
    from snakellm.tokenize import encoders

    r, tok = roundtrip["root"], roundtrip["tok"]
    seen = json.loads((r / "nemo" / "tokenizer.json").read_text())
    ours = encoders.load(tok["kind"], **tok["files"])
    assert seen["ids"] == ours.encode(seen["text"])
    assert seen["vocab_size"] == tok["vocab_size"]
    assert seen["eos_id"] == tok["eod_id"]
    cfg = json.loads((r / "nemo" / "config.json").read_text())
    arch = CASES[roundtrip["style"]]
    assert seen["padded_vocab_size"] == (50304 if roundtrip["style"] == "gpt2" else 512)
    assert cfg["num_layers"] == arch["num_layers"] and cfg["hidden_size"] == arch["hidden_size"]
    assert cfg["mcore_gpt"] is True


def test_nemo_file_layout(roundtrip):
    """SaveRestoreConnector's layout: uncompressed tar, ./ members, nemo:<uuid4hex>_<name> artifacts, torch<2.4-safe .metadata."""
    import pickle

    from snakellm.export.nemo import pickled_globals

    r, style = roundtrip["root"], roundtrip["style"]
    path = r / "out" / f"{style}.nemo"
    assert path.read_bytes()[:2] != b"\x1f\x8b"  # not gzip
    with tarfile.open(path, "r:") as tar:
        names = tar.getnames()
        assert all(n == "." or n.startswith("./") for n in names), names
        assert {
            "./model_config.yaml",
            "./model_weights/.metadata",
            "./model_weights/metadata.json",
            "./model_weights/common.pt",
            "./model_weights/__0_0.distcp",
        } <= set(names)
        cfg = yaml.safe_load(tar.extractfile("./model_config.yaml").read())
        md_bytes = tar.extractfile("./model_weights/.metadata").read()
        assert json.loads(tar.extractfile("./model_weights/metadata.json").read()) == {
            "sharded_backend": "torch_dist",
            "sharded_backend_version": 1,
            "common_backend": "torch",
            "common_backend_version": 1,
        }
    refs = [v for k, v in cfg["tokenizer"].items() if isinstance(v, str) and v.startswith("nemo:")]
    assert refs and all(re.fullmatch(r"nemo:[0-9a-f]{32}_[\w.]+", v) for v in refs)
    assert all(f"./{v[5:]}" in names for v in refs)
    if style == "gpt2":
        assert cfg["tokenizer"]["library"] == "megatron" and cfg["tokenizer"]["type"] == "GPT2BPETokenizer"
        assert cfg["transformer_engine"] is False and "dist_ckpt_load_strictness" not in cfg
    else:
        assert cfg["tokenizer"]["library"] == "sentencepiece"
        assert cfg["transformer_engine"] is True and cfg["dist_ckpt_load_strictness"] == "log_all"
        assert cfg["normalization"] == "rmsnorm" and cfg["activation"] == "swiglu"
        assert cfg["rotary_base"] == CASES[style].get("rotary_base", 10000)
        assert cfg["qkv_bias"] is (style == "qwen2") and cfg["bias"] is False
        assert cfg.get("scale_positional_embedding", False) is (style == "llama3")
        assert cfg.get("sliding_window") == CASES[style].get("sliding_window")
        if style == "llama3":
            assert (cfg["scale_factor"], cfg["low_freq_factor"], cfg["high_freq_factor"], cfg["old_context_len"]) == (
                8.0,
                1.0,
                4.0,
                16,
            )
    md = pickle.loads(md_bytes)
    assert md.storage_meta is None and not hasattr(md, "all_local_plans")
    mdfile = r / "metadata.pickle"
    mdfile.write_bytes(md_bytes)
    classes = pickled_globals(mdfile)
    # everything the pickle refers to exists in torch 2.3 (24.05/24.07 containers); StorageMeta does not
    assert classes <= {
        ("torch", "Size"),
        ("torch", "float32"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        *(
            ("torch.distributed.checkpoint.metadata", n)
            for n in (
                "Metadata",
                "MetadataIndex",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
    }, classes


def test_nemo_save_to_imports_identically(roundtrip):
    """A .nemo written by NeMo's save_to (weights perturbed in NeMo first) -> snakellm import-nemo -> same tensors."""
    import torch

    r = roundtrip["root"]
    imported, theirs = _load(r / "imported" / "state.pt"), _load(r / "nemo" / "resaved_state.pt")
    ours = _load(r / "ours" / "state.pt")
    assert sorted(imported) == sorted(theirs)
    assert all(torch.equal(imported[k], theirs[k]) for k in theirs)
    assert not all(torch.equal(ours[k], theirs[k]) for k in theirs)  # NeMo's weights, not our originals
    li, ln = _load(r / "imported" / "logits.pt"), _load(r / "nemo" / "resaved_logits.pt")
    assert (li - ln).abs().max().item() < 1e-5
    rc = json.loads((r / "runs" / "imported" / "checkpoints" / "run_config.json").read_text())
    arch = CASES[roundtrip["style"]]
    assert all(rc["config"]["model"][k] == v for k, v in arch.items())
    assert rc["tokenizer"]["vocab_size"] == roundtrip["tok"]["vocab_size"]
    assert rc["tokenizer"]["eod_id"] == roundtrip["tok"]["eod_id"]


def test_default_workflow_nemo_loads_in_nemo(default_workflow, nemo_python: Path, tmp_path: Path):
    """runs/tiny/tiny.nemo, made by the export_nemo rule from a real training checkpoint, in NeMo."""
    import torch

    ws = default_workflow
    nemo_file = ws.path("runs/tiny/tiny.nemo")
    assert nemo_file.is_file()
    torch.save(torch.tensor([[5, 17, 99, 250, 3, 1000, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8]]), tmp_path / "batch.pt")
    run([str(nemo_python), str(REPO / "tests" / "nemo_probe.py"), str(nemo_file), "batch.pt", "nemo"], tmp_path)
    run(
        [
            sys.executable,
            str(REPO / "tests" / "nemo_helpers.py"),
            "dump",
            str(ws.path("runs/tiny")),
            "batch.pt",
            "ours",
        ],
        tmp_path,
    )
    ours, theirs = _load(tmp_path / "ours" / "state.pt"), _load(tmp_path / "nemo" / "state.pt")
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    lo, ln = _load(tmp_path / "ours" / "logits.pt"), _load(tmp_path / "nemo" / "logits.pt")
    assert (lo - ln).abs().max().item() < 1e-5
