"""``precision: fp8``: the settings, the refusal on hardware without FP8, and the float8 matmuls on the CPU.

torch's CPU ``_scaled_mm`` multiplies float8 tensors, so the code path a GPU
runs (torchao's casts with dynamic scales, the scaled matmul, megatron-core's
linears around it) runs here too, under :mod:`snakellm.models.fp8`'s test-only
override of the hardware check (``SNAKELLM_FP8_ANY_DEVICE=1``). The numerics
are checked against torchao's own ``Float8Linear`` (bit for bit: the same casts
and kernel) and against bf16 (close, and not equal: float8 is really used).

The fast tier holds the torch-free checks; everything that imports megatron-core and torchao (about
7 s of imports on 2 cores before the first assertion) is marked slow and runs in CI's whole suite.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import env_with_venv
from test_train import BASE, make_blend

from snakellm.models import fp8, resolve
from snakellm.models.architecture import ModelConfigError

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def parallel():
    from snakellm.launch.runtime import ensure_single_process, shutdown

    ensure_single_process("cpu")
    yield
    shutdown()


@pytest.fixture
def any_device(monkeypatch):
    monkeypatch.setenv(fp8.ANY_DEVICE_ENV, "1")


def _tiny(recipe: str | None, seed: int = 0, **kw):
    from snakellm.models.build import build_model

    torch.manual_seed(seed)
    model, _ = build_model(
        resolve("tiny-llama", {}), 256, bf16=True, fused_loss="eager", use_te=False, fp8=recipe, **kw
    )
    return model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ----------------------------------------------------------------------------- settings


def test_settings_schema_and_fingerprint():
    from snakellm.config.sections import FinetuneTrainSettings, TrainSettings
    from snakellm.config.settings import defaults

    for cls in (TrainSettings, FinetuneTrainSettings):
        assert "fp8" in next(f for f in cls.__dataclass_fields__.values() if f.name == "precision").metadata["choices"]
        assert defaults(cls)["fp8_recipe"] == "tensorwise"
    # bf16 and fp32 runs keep the fingerprints they had before fp8 existed; the recipe counts only with fp8
    assert fp8.trajectory("bf16", "rowwise") == {"precision": "bf16"}
    assert fp8.trajectory("fp8", "tensorwise") != fp8.trajectory("fp8", "rowwise")
    assert fp8.te_config("tensorwise") == {"fp8": "hybrid", "fp8_recipe": "tensorwise"}
    with pytest.raises(fp8.FP8Error, match="fp8_recipe 'delayed'"):
        fp8.float8_config("delayed")


@pytest.mark.slow
def test_fp8_runs_record_their_recipe_and_leave_other_fingerprints_alone(tmp_path, monkeypatch):
    from snakellm.steps.train import build_parser
    from snakellm.train.request import make_request, run_config

    make_blend(tmp_path, docs=20)
    monkeypatch.chdir(tmp_path)
    argv = ["--blend", "data/tokens/synth/blend.json", "--run-dir", "runs/r", *BASE, "--steps", "10"]
    req = make_request(build_parser().parse_args([*argv, "--fp8-recipe", "rowwise"]), env={})
    assert "fp8_recipe" not in run_config(req, "bf16")  # the setting is there, but only fp8 runs record it
    assert run_config(req, "fp8")["fp8_recipe"] == "rowwise"
    assert run_config(req, "fp8")["precision"] == "fp8"


# ----------------------------------------------------------------------------- the refusal


@pytest.mark.parametrize(
    "capability, name, ok",
    [((9, 0), "H100", True), ((8, 9), "L40S", True), ((8, 0), "A100", False), ((7, 0), "V100", False)],
)
def test_compute_capability_below_8_9_is_refused_naming_the_setting(capability, name, ok):
    if ok:
        fp8.check_capability(capability, name)
        return
    with pytest.raises(fp8.FP8Error) as e:
        fp8.check_capability(capability, name)
    msg = str(e.value)
    assert "precision: fp8" in msg and f"{capability[0]}.{capability[1]}" in msg and name in msg and "8.9" in msg


def test_fp8_on_the_cpu_is_refused_before_anything_starts(monkeypatch, capsys, tmp_path):
    from snakellm.steps.train import main

    monkeypatch.delenv(fp8.ANY_DEVICE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    args = ["--blend", "blend.json", "--run-dir", "runs/never", *BASE, "--steps", "10"]
    assert main([*args, "--precision", "fp8", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "precision: fp8 (--precision fp8) needs an NVIDIA GPU" in err and "runs on the CPU" in err
    assert not (tmp_path / "runs/never").exists()


@pytest.mark.slow
def test_fp8_model_build_is_refused_on_the_cpu_and_without_bf16(monkeypatch, parallel):
    """The model build (fine-tuning's load, --device auto on a machine without a GPU) refuses too."""
    from snakellm.models.build import build_model

    monkeypatch.delenv(fp8.ANY_DEVICE_ENV, raising=False)
    with pytest.raises(fp8.FP8Error, match="precision: fp8"):
        _tiny("tensorwise")
    monkeypatch.setenv(fp8.ANY_DEVICE_ENV, "1")
    with pytest.raises(ModelConfigError, match="bf16"):
        build_model(resolve("tiny-llama", {}), 256, fused_loss="eager", use_te=False, fp8="tensorwise")


# ----------------------------------------------------------------------------- numerics on the CPU


@pytest.mark.slow
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_megatron_linears_match_torchao_float8_linear_bit_for_bit(parallel, any_device, recipe):
    """Column- and row-parallel linears (TP 1) with the float8 matmul give torchao's Float8Linear's output and
    gradients exactly, and differ from bf16 by float8's rounding (a few percent), not more."""
    from torchao.float8.float8_linear import Float8Linear

    model = _tiny(recipe)
    mlp = model.decoder.layers[0].mlp
    for lin in (mlp.linear_fc1, mlp.linear_fc2):  # ColumnParallelLinear, RowParallelLinear
        assert fp8.is_converted(lin)
        out_f, in_f = lin.weight.shape
        ref = torch.nn.Linear(in_f, out_f, bias=False, dtype=torch.bfloat16)
        ref.weight.data.copy_(lin.weight.data)
        ref8 = Float8Linear.from_float(ref, config=fp8.float8_config(recipe))
        torch.manual_seed(1)
        x = torch.randn(32, 2, in_f, dtype=torch.bfloat16)  # [s, b, h]: megatron's layout
        g = torch.randn(32, 2, out_f, dtype=torch.bfloat16)
        outs = []
        for module in (lin, ref8, ref):
            xi = x.clone().requires_grad_()
            lin.weight.grad = ref.weight.grad = None
            y = module(xi)
            y = y[0] if module is lin else y  # megatron's linears return (output, bias)
            y.backward(g)
            w = lin.weight if module is lin else ref.weight
            outs.append((y.detach(), xi.grad, w.grad.clone()))
        (y, gx, gw), (y8, gx8, gw8), (y16, gx16, gw16) = outs
        assert y.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
        assert torch.equal(y, y8) and torch.equal(gx, gx8) and torch.equal(gw, gw8)
        for a, b in ((y, y16), (gx, gx16), (gw, gw16)):
            assert 1e-3 < rel(a, b) < 0.1


@pytest.mark.slow
def test_frozen_weight_takes_the_input_gradient_only(parallel, any_device):
    """LoRA's frozen base: the same output and input gradient as a trained weight, and no weight gradient."""
    model = _tiny("tensorwise")
    lin = model.decoder.layers[1].self_attention.linear_qkv
    torch.manual_seed(2)
    x = torch.randn(16, 2, lin.weight.shape[1], dtype=torch.bfloat16)
    res = []
    for trainable in (True, False):
        lin.weight.requires_grad_(trainable)
        lin.weight.grad = None
        xi = x.clone().requires_grad_()
        y = lin(xi)[0]
        y.float().square().sum().backward()
        res.append((y.detach(), xi.grad, lin.weight.grad))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
    assert res[0][2] is not None and res[1][2] is None


@pytest.mark.slow
def test_model_converts_only_the_block_linears_and_keeps_its_state_dict(parallel, any_device):
    m16, m8 = _tiny(None), _tiny("tensorwise")
    converted = [n for n, lin in fp8.block_linears(m8) if fp8.is_converted(lin)]
    assert len(converted) == 2 * 4  # 2 layers x qkv, proj, fc1, fc2
    assert not fp8.is_converted(m8.output_layer) and not any(fp8.is_converted(lin) for _, lin in fp8.block_linears(m16))
    sd16, sd8 = m16.state_dict(), m8.state_dict()
    assert sd16.keys() == sd8.keys()
    assert all(torch.equal(sd16[k], sd8[k]) for k in sd16 if isinstance(sd16[k], torch.Tensor))
    assert all(p.dtype == torch.bfloat16 for p in m8.parameters())
    torch.manual_seed(3)
    tok = torch.randint(0, 256, (2, 128))
    pos = torch.arange(128)[None].expand(2, -1)
    l16, l8 = (m(tok, pos, None, labels=tok).float().mean() for m in (m16, m8))
    assert l16.item() != l8.item() and abs(l8.item() / l16.item() - 1) < 1e-3


def test_shapes_float8_kernels_refuse_are_named_before_anything_starts():
    # each tensor-parallel rank's shard: tiny-llama's ffn 176 / 2 = 88
    with pytest.raises(fp8.FP8Error, match=r"linear_fc2 has a 64 x 88 weight on each of the 2 tensor-parallel"):
        fp8.check_request("fp8", "auto", resolve("tiny-llama", {}), tp=2)
    fp8.check_request("fp8", "auto", resolve("tiny-llama", {}), tp=1)
    fp8.check_request("bf16", "cpu", resolve("tiny-llama", {"ffn_hidden_size": 100}), tp=2)
    for preset in ("llama-1b", "llama3-8b", "gpt2-124m"):  # the shapes we benchmark
        fp8.check_shapes(resolve(preset, {}), tp=1)


def test_a_run_config_with_shapes_float8_refuses_names_the_key():
    from snakellm.config import checks, resolve
    from snakellm.errors import ConfigError

    run = {
        "tokenizer": "gpt2",
        "model": {"preset": "tiny-llama"},
        "parallel": {"tp": 2},
        "train": {"steps": 3, "micro_batch_size": 2, "global_batch_size": 4, "precision": "fp8"},
    }
    cfg = {"sources": {}, "tokenizers": {"gpt2": {"kind": "gpt2-bpe"}}, "tokenize": {}, "runs": {"r": run}}
    with pytest.raises(
        ConfigError, match=r"config key runs.r.train.precision: precision: fp8: linear_fc2 has a 64 x 88"
    ):
        checks.check_fp8(cfg, resolve.resolve_runs(cfg))
    run["parallel"]["tp"] = 1
    checks.check_fp8(cfg, resolve.resolve_runs(cfg))
    run["parallel"]["tp"], run["train"]["precision"] = 2, "bf16"
    checks.check_fp8(cfg, resolve.resolve_runs(cfg))


def test_the_float8_all_gather_is_refused_without_fsdp_fp8_or_tensorwise_naming_the_setting(tmp_path):
    """``parallel.fp8_all_gather``: the step refuses it before anything starts and the config check names the
    key, without FSDP, without precision fp8 and with the rowwise recipe."""
    from snakellm.config import checks, resolve
    from snakellm.errors import ConfigError
    from snakellm.steps.train import build_parser
    from snakellm.train.request import RequestError, make_request

    base = ["--blend", "x.json", "--run-dir", str(tmp_path), "--steps", "1", "--micro-batch-size", "1"]
    base += ["--global-batch-size", "1", "--preset", "tiny-llama", "--fp8-all-gather"]
    for extra, why in (
        (["--precision", "fp8"], "--fp8-all-gather casts each FSDP shard to float8 before FSDP's all-gather: it "
         "needs --fsdp"),
        (["--fsdp", "--precision", "bf16"], "--fp8-all-gather gathers float8 weights: it needs precision fp8 "
         "\\(got bf16\\)"),
        (["--fsdp", "--precision", "fp8", "--fp8-recipe", "rowwise"], "it needs fp8_recipe tensorwise \\(got "
         "rowwise\\)"),
    ):  # fmt: skip
        with pytest.raises(RequestError, match=why):
            make_request(build_parser().parse_args(base + extra), env={})
    run = {
        "tokenizer": "gpt2",
        "model": {"preset": "tiny-llama"},
        "parallel": {"fsdp": True, "fp8_all_gather": True},
        "train": {"steps": 3, "micro_batch_size": 2, "global_batch_size": 4, "precision": "bf16"},
    }
    cfg = {"sources": {}, "tokenizers": {"gpt2": {"kind": "gpt2-bpe"}}, "tokenize": {}, "runs": {"r": run}}
    with pytest.raises(ConfigError, match=r"config key runs.r.parallel.fp8_all_gather: the float8 all-gather gathers"):
        checks.check_fp8(cfg, resolve.resolve_runs(cfg))
    run["train"]["precision"] = "fp8"
    checks.check_fp8(cfg, resolve.resolve_runs(cfg))
    run["parallel"]["fsdp"] = False
    with pytest.raises(ConfigError, match=r"runs.r.parallel.fp8_all_gather: the float8 all-gather casts each FSDP"):
        resolve.resolve_runs(cfg)


def test_the_pre_all_gather_cast_is_torchaos_bit_for_bit():
    """The float8-gathered weight's cast (``fp8.weight_cast``, compiled on CUDA) gives the bytes of torchao's
    ``hp_tensor_and_scale_to_float8``, saturating values beyond float8's range; the patched
    ``fsdp_pre_all_gather`` returns them with the precomputed scale, and without one defers to torchao's."""
    import torch

    fp8._torchao()  # imported quietly first (its C++ extensions for other recipes log)
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    g = torch.Generator().manual_seed(0)
    shard = torch.randn(64, 48, generator=g) * torch.logspace(-6, 3, 48)
    shard[0, :4] = torch.tensor([1e9, -1e9, float("inf"), -float("inf")])
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        scale = torch.tensor(448.0 / 7.5)
        theirs = hp_tensor_and_scale_to_float8(shard, scale, dtype, None, GemmInputRole.WEIGHT)._data
        assert torch.equal(fp8.weight_cast(shard, scale, dtype).view(torch.uint8), theirs.view(torch.uint8))
    fp8._fuse_pre_all_gather_cast()
    w = WeightWithDynamicFloat8CastTensor(shard.clone(), None, torch.float8_e4m3fn)
    assert w.fsdp_pre_all_gather(None)[1][0].numel() == 1  # no precomputed scale: torchao's dynamic cast
    w._precomputed_scale = torch.tensor(2.0)
    (data,), (scale,) = w.fsdp_pre_all_gather(None)
    assert scale is w._precomputed_scale
    assert torch.equal(data.view(torch.uint8), fp8.weight_cast(shard, scale, torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.slow
def test_shapes_checked_are_the_shapes_megatron_builds(parallel, any_device):
    from snakellm.models.build import build_model

    model = _tiny("tensorwise")
    built = {n.rsplit(".", 1)[-1]: tuple(lin.weight.shape) for n, lin in fp8.block_linears(model)}
    assert built == fp8.weight_shapes(resolve("tiny-llama", {}))
    arch = resolve("tiny-llama", {"ffn_hidden_size": 100})  # and the build refuses what the request would
    with pytest.raises(fp8.FP8Error, match=r"decoder.layers.0.mlp.linear_fc1 has a 200 x 64 weight"):
        build_model(arch, 256, bf16=True, fused_loss="eager", use_te=False, fp8="tensorwise")


@pytest.mark.slow
def test_lora_on_an_fp8_base_trains_the_adapters_only(parallel, any_device):
    from snakellm.finetune.lora import LoRAAdapters, LoRAConfig

    model = _tiny("tensorwise")
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = LoRAAdapters(model, LoRAConfig(rank=8, targets=["linear_qkv", "linear_fc2"], row_init="normal"))
    tok = torch.randint(0, 256, (2, 64))
    loss = model(tok, torch.arange(64)[None].expand(2, -1), None, labels=tok).float().mean()
    loss.backward()
    assert all(p.grad is None for p in model.parameters())
    grads = [m.a.grad for _, m in adapters.named_adapters()] + [m.b.grad for _, m in adapters.named_adapters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


# ----------------------------------------------------------------------------- snakellm train, TP 2 + SP


@pytest.fixture(scope="module")
def fp8_parallel_runs(tmp_path_factory):
    """The runs of the test below (a shared fixture: five trainings, 90 s in CI, near one test's budget)."""
    tmp_path = tmp_path_factory.mktemp("fp8-parallel")
    env = env_with_venv() | {fp8.ANY_DEVICE_ENV: "1"}
    return tmp_path, env, *_fp8_parallel_runs(tmp_path, env)


def _fp8_parallel_runs(tmp_path, env):
    """`snakellm train --precision fp8` on 2 ranks (gloo) against one process: TP 2 with sequence parallelism
    (the all-gather / reduce-scatter around the float8 matmuls; float8's scales then come from each rank's
    weight shard, so the losses differ slightly), DP 2 with the distributed optimizer (the same micro-batches
    and casts: the losses of one process to float rounding), and FSDP over 2 with the weights all-gathered in
    float8 (``--fp8-all-gather``: each rank casts its fp32 shard with the whole weight's scale, where the
    others cast the gathered bf16 weight: one rounding instead of two), saving at step 3 and resumed there
    (the float8 scales recomputed from the loaded weights: the uninterrupted run's losses)."""
    make_blend(tmp_path)
    common = [*BASE, "--preset", "tiny-llama", "--ffn-hidden-size", "160", "--steps", "6", "--precision", "fp8"]
    common += ["--device", "cpu", "--no-checkpoints", "--eval-iters", "0"]
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "--no-python"]
    runs = {}
    for name, launch, extra in (
        ("one", [], []),
        ("tp2sp", torchrun, ["--tp", "2", "--sequence-parallel", "--loss", "megatron"]),
        ("dp2distopt", torchrun, ["--distributed-optimizer"]),
        ("fsdp8", torchrun, ["--fsdp", "--fp8-all-gather"]),
    ):
        cmd = [*launch, str(BIN / "snakellm"), "train", "--blend", "data/tokens/synth/blend.json"]
        cmd += ["--run-dir", f"runs/{name}", *common, *extra]
        if name == "fsdp8":  # checkpoints at step 3 (resumed below)
            cmd = [c for c in cmd if c != "--no-checkpoints"] + ["--save-interval", "3", "--keep-last", "2"]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        recs = [json.loads(ln) for ln in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = {r["step"]: r["loss"] for r in recs if "loss" in r}
        summary = json.loads((tmp_path / "runs" / name / "train_summary.json").read_text())
        assert summary["precision"] == "fp8"
        if name == "fsdp8":
            assert "the float8 block linears' weights are all-gathered in float8" in proc.stderr
            resume = [c if c != "runs/fsdp8" else "runs/fsdp8-resumed" for c in cmd]
    return runs, resume


@pytest.mark.slow
def test_parallel_fp8_training_follows_one_process(fp8_parallel_runs):
    """TP 2 + sequence parallelism, DP 2 with the distributed optimizer and FSDP 2 with the float8 all-gather,
    each against one process (the fixture's runs), and the FSDP run resumed from its step-3 checkpoint."""
    tmp_path, env, runs, resume = fp8_parallel_runs
    # the float8 all-gather's checkpoint at step 3 resumes with the uninterrupted run's losses
    ckpts = tmp_path / "runs/fsdp8/checkpoints"
    shutil.copytree(tmp_path / "runs/fsdp8", tmp_path / "runs/fsdp8-resumed")
    (tmp_path / "runs/fsdp8-resumed/checkpoints/latest_checkpointed_iteration.txt").write_text("3\n")
    assert (ckpts / "iter_0000003").is_dir()
    proc = subprocess.run(resume, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "resumed from runs/fsdp8-resumed/checkpoints/iter_0000003" in proc.stderr
    recs = [json.loads(ln) for ln in (tmp_path / "runs/fsdp8-resumed/metrics.jsonl").read_text().splitlines()]
    resumed = {r["step"]: r["loss"] for r in recs if "loss" in r and r["step"] > 3}
    assert resumed == {s: runs["fsdp8"][s] for s in (4, 5, 6)}, (resumed, runs["fsdp8"])
    for name, rtol in (("tp2sp", 5e-3), ("dp2distopt", 1e-4), ("fsdp8", 1e-3)):
        assert runs[name].keys() == set(range(1, 7))
        worst = max(abs(runs[name][s] / loss - 1) for s, loss in runs["one"].items())
        assert worst < rtol, (name, worst, runs["one"], runs[name])


# ----------------------------------------------------------------------------- snakellm finetune, LoRA on an fp8 base


@pytest.mark.slow
def test_lora_finetune_on_an_fp8_base_follows_bf16(tmp_path, parallel, any_device):
    """`snakellm finetune --method lora --precision fp8` (the frozen base's matmuls in float8, the adapters bf16)
    trains as the bf16 fine-tune does, records fp8 (and its recipe) in its fingerprint, and writes the adapter."""
    from conftest import REPO

    from snakellm import models
    from snakellm.finetune.artifacts import save_model
    from snakellm.models.build import build_model

    sys.path.insert(0, str(REPO / "scripts"))
    from bench_finetune_gpu import small_gpt2

    # GPT-2's BPE cut to its first 1,024 merges: the bf16 GPT-2 output layer was most of a CPU step (no bf16
    # matrix units here)
    tok = small_gpt2(tmp_path)
    arch = resolve("tiny-llama", {})
    vocab = models.padded_vocab_size(tok["vocab_size"], arch)
    torch.manual_seed(0)
    gpt, _ = build_model(arch, vocab, fused_loss="eager", use_te=False)
    save_model(gpt, tmp_path / "base", arch, vocab, tok)
    book = [json.loads(ln)["text"] for ln in (REPO / "resources/corpus/botchan/botchan.jsonl").read_text().splitlines()]
    (tmp_path / "sft").mkdir()
    # short examples, seq 64, 4 a step
    recs = [{"input": book[i][:120], "output": f" the answer is {i}"} for i in range(16)]
    for split in ("train", "validation"):
        (tmp_path / "sft" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = {}
    for precision in ("bf16", "fp8"):
        cmd = [str(BIN / "snakellm"), "finetune", "--base", "base", "--data-dir", "sft", "--out-dir", precision]
        cmd += ["--method", "lora", "--lora-targets", "linear_qkv,linear_fc1", "--steps", "6", "--lr", "1e-2"]
        cmd += ["--micro-batch-size", "2", "--global-batch-size", "4", "--max-seq-length", "64"]
        cmd += ["--eval-interval", "6", "--precision", precision, "--device", "cpu", "--no-progress"]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env_with_venv(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        recs = [json.loads(ln) for ln in (tmp_path / precision / "metrics.jsonl").read_text().splitlines()]
        out[precision] = [r["loss"] for r in recs if "loss" in r]
        assert (tmp_path / precision / "adapter").is_dir()
        cfg = json.loads((tmp_path / precision / "checkpoints" / "run_config.json").read_text())["config"]["train"]
        assert cfg["precision"] == precision and ("fp8_recipe" in cfg) == (precision == "fp8")
    assert len(out["bf16"]) == len(out["fp8"]) == 6
    assert out["fp8"] != out["bf16"]  # float8 is really used
    for a, b in zip(out["bf16"], out["fp8"]):
        assert abs(b / a - 1) < 0.01, (out["bf16"], out["fp8"])
    assert out["fp8"][-1] < out["fp8"][0]


# ~200 s alone on 2 cores, 235-300 s in CI beside another worker: two real `snakellm finetune` + `snakellm evaluate`
# runs, the GPU check's own path; the FP8 fine-tune is ~80% of it (its bf16 GPT-2 output layer: this 2-core machine's
# CPU, AVX2 without bf16 matrix units, ~2.5 GFLOP/s against fp32's 28); fewer steps would not memorise the questions
@pytest.fixture(scope="module")
def fp8_lora_smoke(tmp_path_factory):
    """The check script's smoke, run once (a shared fixture: two fine-tunes and two evaluations)."""
    from conftest import REPO

    tmp_path = tmp_path_factory.mktemp("fp8-lora")
    cmd = [sys.executable, str(REPO / "scripts" / "check_fp8_lora_gpu.py"), "--smoke"]
    cmd += ["--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env_with_venv(), timeout=600)
    return proc, tmp_path


@pytest.mark.slow
def test_the_fp8_lora_check_script_smoke(fp8_lora_smoke):
    """`scripts/check_fp8_lora_gpu.py --smoke`: LoRA on an FP8 base (emulated on the CPU) memorises the 8 questions
    as LoRA on the fp32 base does: the same exact match, and the script's loss bar (at most 1.1 x + 0.01 nats)."""
    proc, tmp_path = fp8_lora_smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bar: FP8 exact match >= fp32's less one question: PASS" in proc.stdout
    ref, fp8 = json.loads((tmp_path / "out" / "fp8_lora.json").read_text())["rows"]
    assert (ref["precision"], fp8["precision"]) == ("fp32", "fp8")
    assert ref["exact_match"] >= 0.5 and fp8["exact_match"] == ref["exact_match"]
    assert fp8["last_loss"] < 0.9 * fp8["first_loss"]
