"""DPO (method dpo): preference pairs, TRL's tokenization and losses, the reference_logprobs target."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from hf_helpers import random_checkpoint, tokenizer_block

REPO = Path(__file__).resolve().parent.parent
PAIRS = [
    {"prompt": "Tell me about the garden.\n", "chosen": "The garden is lovely.", "rejected": "The garden is awful."},
    {"prompt": "What of the river?\n", "chosen": "I find the river charming.", "rejected": "It is dismal, truly."},
    {"prompt": "Describe the tower.", "chosen": " Tall and splendid.", "rejected": " Ugly."},
    {"prompt": "", "chosen": "Honestly, the park is wonderful.", "rejected": "Honestly, the park is nasty."},
]


def test_prepare_preference_keeps_pairs_and_quarantines_bad_ones_with_place_and_reason(tmp_path):
    from snakellm.finetune.sft_data import prepare

    src = tmp_path / "p.jsonl"
    good = [dict(p, id=i) for i, p in enumerate(PAIRS)] * 3
    bad = [
        {"prompt": "a", "chosen": "b"},
        {"prompt": "a", "chosen": "same", "rejected": "same"},
        {"prompt": "a", "chosen": "  ", "rejected": "x"},
        {"prompt": 3, "chosen": "x", "rejected": "y"},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in good + bad) + "not json\n")
    stats = prepare(str(src), str(tmp_path / "out"), fmt="preference", split="2,1,1")
    assert stats["accepted"] == 12 and stats["rejected"] == 5
    assert stats["rejected_by_reason"] == {
        "chosen equals rejected": 1,
        "empty chosen": 1,
        "missing key rejected": 1,
        "non-string prompt": 1,
        "not valid JSON": 1,
    }
    rej = [json.loads(x) for x in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert rej[0]["where"] == f"{src}:13" and rej[0]["reason"] == "missing key rejected"
    rows = [json.loads(x) for s in ("train", "validation", "test") for x in (tmp_path / "out" / f"{s}.jsonl").open()]
    assert len(rows) == 12 and all({"prompt", "chosen", "rejected"} <= set(r) for r in rows)


def test_truncation_as_trl():
    from snakellm.finetune.preference import Side, Truncation, truncate

    p, c = [1, 2, 3, 4], [5, 6, 7]
    assert truncate(p, c, Truncation(5, None, "keep_start")) == Side([1, 2, 3, 4, 5], 4)
    assert truncate(p, c, Truncation(5, None, "keep_end")) == Side([3, 4, 5, 6, 7], 2)
    assert truncate(p, c, Truncation(None, 2, "keep_end")) == Side([3, 4, 5, 6, 7], 2)
    assert truncate(p, c, Truncation(None, 2, "keep_start")) == Side([1, 2, 5, 6, 7], 2)


def test_dpo_settings_we_cannot_honour_are_refused_by_name():
    from snakellm.finetune.preference import check_settings

    assert "dpo.label_smoothing" in check_settings("sigmoid", 0.1, 0.1, "base", "lora")
    assert "dpo.label_smoothing" in check_settings("robust", 0.1, 0.5, "base", "lora")
    assert "dpo.reference adapter-off" in check_settings("sigmoid", 0.1, 0.0, "adapter-off", "full")
    assert check_settings("robust", 0.1, 0.2, "adapter-off", "lora") is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Llama with the GPT-2 tokenizer as our checkpoint and its transformers export."""
    from snakellm.export.hf import export_hf
    from snakellm.models.loading import load

    root = tmp_path_factory.mktemp("dpo-tiny")
    random_checkpoint(root / "run", {}, tokenizer_block("gpt2-bpe"), preset="tiny-llama", seed=3)
    loaded = load(root / "run")
    hf_dir = export_hf(loaded, root / "run" / "hf")
    loaded.model.float()
    return loaded, Path(hf_dir)


@pytest.mark.slow  # TRL's import, the tiny model and its export: about 40 s for the four losses
@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge", "robust"])
def test_one_step_equals_trl_dpotrainer(tiny, tmp_path, loss):
    """Tokenization, loss, summed log-probabilities and gradients equal TRL's DPOTrainer (fp32, CPU), the
    policy equal to the reference (as in the workflow's first step): within 1e-5."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from snakellm.finetune import preference as pref
    from snakellm.finetune.runtime import load_tokenizer

    loaded, hf_dir = tiny
    beta, ls = 0.1, (0.2 if loss == "robust" else 0.0)
    at = AutoTokenizer.from_pretrained(hf_dir)
    at.pad_token = at.eos_token
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    args = DPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=beta,
        loss_type=[loss],
        label_smoothing=ls,
        report_to=[],
        per_device_train_batch_size=4,
        use_cpu=True,
        bf16=False,
        dataset_num_proc=None,
    )
    trainer = DPOTrainer(
        model=hf, ref_model=copy.deepcopy(hf), args=args, train_dataset=Dataset.from_list(PAIRS), processing_class=at
    )
    ds = trainer.train_dataset
    tok = load_tokenizer(loaded.tokenizer)
    ours = [pref.tokenize(tok, r) for r in PAIRS]
    assert [(d["prompt_ids"], d["chosen_ids"], d["rejected_ids"]) for d in ds] == [tuple(o) for o in ours]

    batch = trainer.data_collator([ds[i] for i in range(len(ds))])
    hf.train()
    theirs = trainer.compute_loss(hf, batch)
    theirs.backward()
    m = trainer._metrics["train"]

    gpt = loaded.model
    gpt.train()
    gpt.zero_grad(set_to_none=True)
    hook = pref.mask_padded_vocab(gpt, int(loaded.tokenizer["vocab_size"]))
    try:
        pairs, _ = pref.encode_pairs(tok, PAIRS, pref.Truncation())
        b = pref.collate(pairs, tok.eod_id)
        lp = pref.sequence_logps(gpt, b)
        with torch.no_grad():
            ref = pref.sequence_logps(gpt, b)
        n = len(pairs)
        mt = b["loss_mask"].sum(1)
        mine, stats = pref.preference_loss(
            lp[:n],
            lp[n:],
            ref[:n],
            ref[n:],
            loss=loss,
            beta=beta,
            label_smoothing=ls,
            completion_tokens=(b["completion_tokens"][:n], b["completion_tokens"][n:]),
            predicted_tokens=(mt[:n], mt[n:]),
        )
        mine.backward()
    finally:
        if hook is not None:
            hook.remove()
    assert abs(mine.item() - theirs.item()) < 1e-5
    if loss == "sigmoid":
        assert abs(mine.item() - math.log(2)) < 1e-6
    for k in pref.METRICS:
        assert abs(stats[k].item() - m[k][-1]) < 1e-5 * max(1.0, abs(m[k][-1])), k
    V = int(loaded.tokenizer["vocab_size"])
    g_ours = gpt.embedding.word_embeddings.weight.grad[:V]
    g_theirs = hf.model.embed_tokens.weight.grad
    assert (g_ours - g_theirs).abs().max().item() < 1e-5
    g_norm = gpt.decoder.final_layernorm.weight.grad
    assert (g_norm - hf.model.norm.weight.grad).abs().max().item() < 1e-5


# ---------------------------------------------------------------- the workflow

SIX = PAIRS + [
    {"prompt": "Say something about the lake.\n", "chosen": "The lake is pleasant.", "rejected": "The lake is nasty."},
    {"prompt": "And the farm?\n", "chosen": "The farm looks delightful today.", "rejected": "It looks horrible."},
]


def _dpo_config() -> dict:
    return {
        "import_hf": {"tl": {"hf_dir": "models/random/tl", "random": {"preset": "tiny-llama", "seed": 3}}},
        "sft_data": {"prefs": {"path": "prefs.jsonl", "format": "preference", "split": "4,1,1", "seed": 1}},
        "finetune": {
            "dpo": {
                "run": "tl",
                "data": "prefs",
                "method": "dpo",
                "dpo": {"beta": 0.1, "loss": "sigmoid"},
                "lora": {"rank": 4, "targets": ["linear_qkv", "linear_fc2"]},
                "train": {"steps": 2, "micro_batch_size": 2, "global_batch_size": 4, "precision": "fp32"},
                "parallel": {"threads": 1},
            }
        },
        "export_hf": {"enabled": False},
    }


@pytest.fixture(scope="module")
def dpo_ws(tmp_path_factory):
    import shutil

    from conftest import Workspace

    root = tmp_path_factory.mktemp("dpo-workflow")
    shutil.copytree(REPO / "resources" / "tokenizers", root / "resources" / "tokenizers")
    (root / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in SIX))
    ws = Workspace(root)
    ws.write_config(_dpo_config())
    ws.run("runs/tl/finetune/dpo/finetune_summary.json", timeout=600)
    return ws


@pytest.mark.slow  # a random tiny Llama imported, its reference log-probs, two DPO steps: about a minute
def test_first_workflow_step_is_trls_with_transformers_logps(dpo_ws):
    """Policy = reference at step 1: loss ln 2, rewards 0, logps/* = transformers' log-probabilities of the four
    training pairs under TRL's tokenization (the mean over the global batch) within 1e-3."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from snakellm.finetune.preference import tokenize

    ws = dpo_ws
    first = json.loads(ws.path("runs/tl/finetune/dpo/metrics.jsonl").read_text().splitlines()[0])
    assert abs(first["loss"] - math.log(2)) < 1e-5
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(first[k]) < 1e-5, k
    assert {"rewards/accuracies", "logps/chosen", "logps/rejected"} <= set(first)
    train = [json.loads(x) for x in ws.path("data/sft/prefs/train.jsonl").read_text().splitlines()]
    assert len(train) == 4
    hf = AutoModelForCausalLM.from_pretrained(ws.path("models/random/tl"), dtype=torch.float32).eval()
    at = AutoTokenizer.from_pretrained(ws.path("models/random/tl"))

    class Tok:  # transformers' own tokenizer through TRL's rule
        eod_id, eod_token = at.eos_token_id, at.eos_token

        @staticmethod
        def encode(text: str) -> list[int]:
            return at(text)["input_ids"]

    sums = {"chosen": [], "rejected": []}
    for r in train:
        p, c, rj = tokenize(Tok, r)
        for side, comp in (("chosen", c), ("rejected", rj)):
            ids = torch.tensor([p + comp])
            with torch.no_grad():
                lp = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1)
            tgt = ids[0, 1:]
            sums[side].append(lp[torch.arange(len(tgt)), tgt][max(len(p) - 1, 0) :].sum().item())
    for side in ("chosen", "rejected"):
        assert abs(first[f"logps/{side}"] - sum(sums[side]) / 4) < 1e-3, side
    summary = json.loads(ws.path("runs/tl/finetune/dpo/finetune_summary.json").read_text())
    assert summary["test"]["pairs"] == 1 and "rewards/accuracies" in summary["test"]


@pytest.mark.slow
def test_reference_is_not_rebuilt_for_beta_loss_lr_or_steps_only_for_its_inputs(dpo_ws):
    """Snakemake's own -n: a new beta, loss, learning rate or step count reruns the fine-tune only; a new
    truncation (the pairs' tokens) or reference model rebuilds the reference_logprobs target too."""
    ws = dpo_ws
    base = _dpo_config()
    ft = base["finetune"]["dpo"]
    ref_rule = "reference_logprobs"
    changes = [
        ("dpo", {"beta": 0.5, "loss": "sigmoid"}, False),
        ("dpo", {"beta": 0.1, "loss": "hinge"}, False),
        ("train", {**ft["train"], "lr": 1.0e-3, "steps": 5}, False),
        ("dpo", {"beta": 0.1, "loss": "sigmoid", "max_length": 20}, True),
    ]
    try:
        for key, value, rebuilt in changes:
            cfg = copy.deepcopy(base)
            cfg["finetune"]["dpo"][key] = value
            ws.write_config(cfg)
            out = ws.run("-n", "runs/tl/finetune/dpo/finetune_summary.json")
            plan = out.stdout + out.stderr
            assert "rule finetune:" in plan, (key, value)
            assert (f"rule {ref_rule}:" in plan) == rebuilt, (key, value, plan[-2000:])
    finally:
        ws.write_config(base)
    assert ws.nothing_to_do("runs/tl/finetune/dpo/finetune_summary.json")


# on the default workflow's tiny run: a 20-step full SFT (~10 s), the reference target (~18 s), 40 DPO steps
# (~45 s on 2 busy cores), the comparison, the report page and three dry runs: about 90 s
@pytest.mark.slow
def test_tiny_dpo_example_learns_the_held_out_preference(default_workflow):
    """config/examples/tiny-dpo.yaml through Snakemake, SFT then DPO: in the comparison, held-out reward
    accuracy (ties half) from 0.5 (the initial policy is the reference, the SFT model: every reward 0; TRL's
    strict rewards/accuracies 0) to 0.9 or more, with a positive margin; the report page shows the table. A
    new beta reruns only the DPO fine-tune; a retrained SFT model its reference and the DPO fine-tune too.
    docs/finetuning-and-evaluation.md quotes the numbers."""
    import yaml
    from conftest import Workspace

    from snakellm.eval import compare

    root = default_workflow.root
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg |= yaml.safe_load((REPO / "config" / "examples" / "tiny-dpo.yaml").read_text())
    ws = Workspace(root)
    ws.config_path = root / "config-dpo-example.yaml"
    ws.write_config(cfg)
    cmp_, page = "runs/tiny/eval/tiny-dpo/comparison.json", "results/report/finetune/tiny/tiny-dpo.html"
    ws.run(cmp_, page, timeout=900)
    summary = json.loads((root / "runs/tiny/finetune/tiny-dpo/finetune_summary.json").read_text())
    c = json.loads((root / cmp_).read_text())
    rows = {r["metric"]: r for r in c["metrics"]}
    print("tiny-dpo", summary["first_step"], {k: (r["base"], r["tuned"]) for k, r in rows.items()})
    assert abs(summary["first_step"]["loss"] - math.log(2)) < 1e-5
    assert c["examples"] == summary["test"]["pairs"] == 16
    assert [r["metric"] for r in c["metrics"]] == [m for m, _ in compare.PREFERENCE_METRICS]
    assert rows["reward_accuracy"]["base"] == 0.5 and rows["reward_accuracy"]["tuned"] >= 0.9
    assert rows["rewards/accuracies"]["base"] == 0.0 and rows["rewards/accuracies"]["tuned"] >= 0.9
    assert rows["rewards/margins"]["base"] == 0.0 and rows["rewards/margins"]["tuned"] > 0
    assert abs(rows["loss"]["base"] - math.log(2)) < 1e-6 and rows["loss"]["tuned"] < rows["loss"]["base"]
    # the initial policy's log-probabilities are the reference's (the SFT model's), read from its target
    ref = json.loads((root / "runs/tiny/finetune/tiny-dpo/reference_logprobs.json").read_text())
    assert ref["reference"] == "runs/tiny/finetune/tiny-dpo-sft/model"
    # float32 sums in a different order: within float32's resolution of the value (~47 nats: 4e-6)
    assert math.isclose(rows["logps/chosen"]["base"], sum(ref["splits"]["test"]["chosen"]) / 16, rel_tol=1e-6)
    assert summary["test"]["rewards/accuracies"] >= 0.9 and summary["test"]["rewards/margins"] > 0
    from snakellm.report.html import fmt

    html = (root / page).read_text()
    assert "base vs tuned on the held-out test pairs" in html
    for r in c["metrics"]:  # the comparison file's table, with which way is better (as tests/test_report.py)
        cells = "".join(f'<td class="num">{fmt(r[k])}</td>' for k in ("base", "tuned", "difference"))
        better = "higher" if r["higher_is_better"] else "lower"
        assert f"<td>{r['metric']}</td>{cells}<td>{better}</td>" in html, r
    assert "Preference metrics (DPO)" in html and "held-out test pairs" in html
    try:  # what reruns: a new beta only the DPO fine-tune; a new SFT model its reference and the DPO too
        for ft, key, value, again in (
            ("tiny-dpo", "dpo", {**cfg["finetune"]["tiny-dpo"]["dpo"], "beta": 0.2}, {"tiny-dpo"}),
            ("tiny-dpo-sft", "train", {**cfg["finetune"]["tiny-dpo-sft"]["train"], "lr": 2e-3}, {"tiny-dpo", "sft"}),
        ):
            changed = json.loads(json.dumps(cfg))
            changed["finetune"][ft][key] = value
            ws.write_config(changed)
            plan = ws.run("-n", cmp_, timeout=120).stdout
            assert "wildcards: run=tiny, ft=tiny-dpo\n" in plan and "rule compare_finetune:" in plan
            assert ("ft=tiny-dpo-sft" in plan) == ("sft" in again), plan[-3000:]
            assert ("rule reference_logprobs:" in plan) == ("sft" in again), plan[-3000:]
    finally:
        ws.write_config(cfg)
    assert ws.nothing_to_do(cmp_, page)


CONV = [
    {
        "prompt": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "How is the garden?"}],
        "chosen": [{"role": "assistant", "content": "The garden is lovely."}],
        "rejected": [{"role": "assistant", "content": "The garden is awful."}],
    },
    {
        "prompt": [{"role": "user", "content": "And the river?"}],
        "chosen": [{"role": "assistant", "content": "Charming, truly."}],
        "rejected": [{"role": "assistant", "content": "Dismal."}],
    },
]


def test_conversational_pairs_are_prepared_and_bad_ones_quarantined(tmp_path):
    from snakellm.finetune.sft_data import prepare

    bad = [
        dict(CONV[0], chosen=[]),
        dict(CONV[0], rejected=CONV[0]["chosen"]),
        dict(CONV[0], chosen=[{"role": "wizard", "content": "x"}]),
        dict(CONV[0], prompt="a string"),
    ]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in CONV * 3 + bad))
    stats = prepare(str(src), str(tmp_path / "out"), fmt="preference", split="4,1,1")
    assert stats["accepted"] == 6 and stats["rejected"] == 4
    assert set(stats["rejected_by_reason"]) == {
        "empty chosen",
        "chosen equals rejected",
        "chosen: unknown role 'wizard' (message 2)",  # counted over prompt + chosen
        "mixed forms: prompt, chosen and rejected must all be message lists (or all strings)",
    }


@pytest.mark.slow  # TRL's import and the tiny model's export (shared with the test above)
def test_conversational_tokenization_equals_trl(tiny, tmp_path):
    """The conversational form through the run's chat template (here the built-in chatml): TRL's ids."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from snakellm.finetune import conversations as conv
    from snakellm.finetune import preference as pref
    from snakellm.finetune.chat_template import load_template
    from snakellm.finetune.runtime import load_tokenizer

    loaded, hf_dir = tiny
    at = AutoTokenizer.from_pretrained(hf_dir)
    at.pad_token = at.eos_token
    at.chat_template = load_template("chatml", None).text
    hf = AutoModelForCausalLM.from_pretrained(hf_dir)
    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False)
    trainer = DPOTrainer(model=hf, args=args, train_dataset=Dataset.from_list(CONV), processing_class=at)
    tok = load_tokenizer(loaded.tokenizer)
    chat = conv.chat_encoder(loaded.tokenizer, tok, "chatml", 128, "all_assistant")
    ours = [pref.tokenize(tok, r, chat) for r in CONV]
    theirs = [(d["prompt_ids"], d["chosen_ids"], d["rejected_ids"]) for d in trainer.train_dataset]
    assert theirs == [tuple(o) for o in ours]


@pytest.mark.slow  # TRL's CPOTrainer on the tiny model (shared fixture)
def test_simpo_equals_trl_cpotrainer(tiny, tmp_path):
    """SimPO (reference-free, length-normalised, margin gamma, CPO's label smoothing) = TRL's CPOTrainer with
    loss_type simpo and cpo_alpha 0 on our models' average completion log-probabilities."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    from snakellm.finetune import preference as pref
    from snakellm.finetune.runtime import load_tokenizer

    loaded, hf_dir = tiny
    at = AutoTokenizer.from_pretrained(hf_dir)
    at.pad_token = at.eos_token
    args = CPOConfig(
        output_dir=str(tmp_path / "cpo"),
        loss_type="simpo",
        cpo_alpha=0.0,
        beta=2.0,
        simpo_gamma=0.7,
        label_smoothing=0.1,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    hf = AutoModelForCausalLM.from_pretrained(hf_dir)
    trainer = CPOTrainer(model=hf, args=args, train_dataset=Dataset.from_list(PAIRS), processing_class=at)
    tok = load_tokenizer(loaded.tokenizer)
    gpt = loaded.model.eval()
    hook = pref.mask_padded_vocab(gpt, int(loaded.tokenizer["vocab_size"]))
    try:
        pairs, _ = pref.encode_pairs(tok, PAIRS, pref.Truncation())
        b = pref.collate(pairs, tok.eod_id)
        with torch.no_grad():
            lp = pref.sequence_logps(gpt, b)
    finally:
        if hook is not None:
            hook.remove()
    n, mt = len(pairs), b["loss_mask"].sum(1)
    mine, stats = pref.preference_loss(
        lp[:n],
        lp[n:],
        None,
        None,
        loss="simpo",
        beta=2.0,
        label_smoothing=0.1,
        simpo_gamma=0.7,
        predicted_tokens=(mt[:n], mt[n:]),
    )
    losses, chosen_r, rejected_r = trainer.cpo_loss(lp[:n] / mt[:n], lp[n:] / mt[n:])
    assert abs(mine.item() - losses.mean().item()) < 1e-6
    assert abs(stats["rewards/chosen"].item() - chosen_r.mean().item()) < 1e-6
    assert abs(stats["rewards/margins"].item() - (chosen_r - rejected_r).mean().item()) < 1e-6


@pytest.mark.slow  # ~2 s; the fast tier's 90 s has no room
def test_the_fine_tune_page_draws_the_preference_metrics_only_for_dpo(tmp_path):
    """A DPO fine-tune's report page: reward accuracy and margins per step, chosen and rejected rewards, the
    held-out test metrics, and the base-vs-tuned table of its comparison where given; an SFT fine-tune's page has
    no such figure."""
    from snakellm.report.evaluation import finetune_page, preference_figure

    recs = [
        {
            "step": s,
            "loss": 0.69 - s / 100,
            "rewards/chosen": s / 50,
            "rewards/rejected": -s / 40,
            "rewards/accuracies": min(1.0, 0.5 + s / 40),
            "rewards/margins": s / 50 + s / 40,
            "logps/chosen": -20.0 + s / 10,
            "logps/rejected": -22.0 - s / 10,
        }
        for s in range(1, 21)
    ]
    svg = preference_figure("pref", recs)
    assert svg is not None and svg.startswith("<svg") and "reward accuracy" in svg and "rejected reward" in svg
    summary = {"method": "dpo", "base": "runs/tiny", "test": {"pairs": 4, "rewards/accuracies": 0.75}}
    page = finetune_page("pref", summary, {}, {}, [], [], None, recs)
    assert "Preference metrics (DPO)" in page and "<svg" in page and "held-out test pairs" in page
    assert "base vs tuned" not in page
    # with its comparison (snakellm compare-eval --preference): the held-out table first
    rows = [{"metric": "reward_accuracy", "base": 0.5, "tuned": 0.9375, "difference": 0.4375, "higher_is_better": True}]
    page = finetune_page("pref", summary, {}, {}, [], [], {"examples": 16, "metrics": rows}, recs)
    assert page.index("base vs tuned on the held-out test pairs") < page.index("Preference metrics (DPO)")
    assert "reward_accuracy" in page and "0.9375" in page and "16 pairs" in page
    sft = [{k: v for k, v in r.items() if "/" not in k} for r in recs]
    assert preference_figure("sft", sft) is None
    sft_page = finetune_page("sft", {"method": "lora"}, {"loss": 2.0}, {"loss": 1.5}, [], [], None, sft)
    assert "Preference metrics" not in sft_page and "base vs tuned" in sft_page


@pytest.mark.slow  # 1.9 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
def test_report_finetune_writes_a_dpo_page_without_evaluations(tmp_path):
    """`snakellm report finetune` for a DPO fine-tune: only its metrics and summary (the rule passes no
    --base/--tuned flags for one)."""
    from snakellm.steps.report import main

    m = tmp_path / "metrics.jsonl"
    m.write_text(
        "".join(
            json.dumps({"step": s, "loss": 0.7, "rewards/margins": 0.1 * s, "rewards/accuracies": 1.0}) + "\n"
            for s in (1, 2)
        )
    )
    (tmp_path / "s.json").write_text(json.dumps({"method": "dpo", "dpo": {"beta": 0.1}}))
    page, loss = tmp_path / "p.html", tmp_path / "l.svg"
    main(
        ["finetune", "--name", "d", "--metrics", str(m), "--summary", str(tmp_path / "s.json")]
        + ["--page", str(page), "--loss", str(loss)]
    )
    assert "Preference metrics (DPO)" in page.read_text() and loss.is_file()


# ---------------------------------------------------------------- resume, TP and FSDP on CPU ranks (fp32)

CPU_FT = ["finetune", "--base", "base", "--data-dir", "pref", "--method", "dpo", "--dpo-policy", "full"]
CPU_FT += ["--reference-logprobs", "ref.json", "--steps", "6", "--lr", "1e-3", "--micro-batch-size", "1"]
CPU_FT += ["--global-batch-size", "4", "--max-seq-length", "64", "--eval-interval", "3", "--keep-last", "2"]
CPU_FT += ["--select", "last", "--device", "cpu", "--no-progress"]


def _dpo_cpu(root: Path, out: str, nproc: int, *extra: str) -> str:
    """`snakellm finetune --method dpo` (a full policy, the base's reference file) on NPROC CPU ranks: stderr."""
    from test_finetune_fsdp_cpu import BIN, TORCHRUN, _run

    return _run(
        [*(TORCHRUN if nproc > 1 else []), str(BIN / "snakellm"), *CPU_FT, "--out-dir", out, *extra], root
    ).stderr


def _steps(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def dpo_cpu(tmp_path_factory) -> Path:
    """A random tiny Llama base (tests/test_finetune_fsdp_cpu.py's), 16/4/4 preference pairs, the base's
    reference log-probabilities and one uninterrupted 6-step DPO run in one process (~25 s on 2 cores)."""
    import sys

    from test_finetune_fsdp_cpu import BIN, MAKE, _run

    root = tmp_path_factory.mktemp("dpo-cpu")
    _run([sys.executable, "-c", MAKE, str(REPO)], root)
    recs = [dict(PAIRS[i % 4], prompt=f"{PAIRS[i % 4]['prompt'].rstrip()} ({i})\n") for i in range(24)]
    (root / "pref").mkdir()
    for split, rs in (("train", recs[:16]), ("validation", recs[16:20]), ("test", recs[20:])):
        (root / "pref" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    ref = ["reference-logprobs", "--model", "base", "--data-dir", "pref", "--out", "ref.json"]
    _run([str(BIN / "snakellm"), *ref, "--max-seq-length", "64", "--device", "cpu"], root)
    _dpo_cpu(root, "one", 1)
    return root


@pytest.mark.slow  # the fixture (20-55 s) and one resumed launch (8-30 s) on 2 cores
def test_a_stopped_dpo_fine_tune_resumes_with_the_uninterrupted_runs_losses(dpo_cpu):
    """Point 4: DPO resumed from its step-3 checkpoint continues with the uninterrupted run's losses, TRL
    metrics and validation losses bit for bit (fp32 on the CPU), as SFT's resume does."""
    import shutil

    shutil.copytree(dpo_cpu / "one", dpo_cpu / "resumed")
    (dpo_cpu / "resumed" / "checkpoints/latest_checkpointed_iteration.txt").write_text("3\n")
    assert "resumed from resumed/checkpoints/iter_0000003" in _dpo_cpu(dpo_cpu, "resumed", 1)
    one, resumed = _steps(dpo_cpu / "one"), _steps(dpo_cpu / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, 7)) and resumed[2].get("resumed")
    keys = ("loss", "grad_norm", "val_loss", *(k for k in one[0] if "/" in k))
    assert len(keys) > 8
    assert [[r.get(k) for k in keys] for r in resumed[3:]] == [[r.get(k) for k in keys] for r in one[3:]]
    assert one[-1]["loss"] < one[0]["loss"]


@pytest.mark.slow  # the shared fixture and two 1-step launches: 15-30 s on 2 cores
def test_the_held_out_base_side_is_the_initial_policys(dpo_cpu):
    """The comparison's base side (finetune_summary.json's test_before): where the policy starts as its
    reference (the base's file, a full policy) it is the reference's numbers (reward_accuracy 0.5, TRL's strict
    accuracy 0, rewards 0) with no forward pass, and a real forward pass of the initial policy gives them too
    (one step at lr 0 leaves the policy as it was: its "test" equals "test_before"); for SimPO (no reference)
    it is the initial policy's forward pass before the first step, again equal to the lr-0 step's test."""
    one = json.loads((dpo_cpu / "one" / "finetune_summary.json").read_text())
    ref = json.loads((dpo_cpu / "ref.json").read_text())["splits"]["test"]
    before = one["test_before"]
    assert before["pairs"] == 4 and before["reward_accuracy"] == 0.5 and before["rewards/accuracies"] == 0.0
    assert before["rewards/margins"] == before["rewards/chosen"] == 0.0 and abs(before["loss"] - math.log(2)) < 1e-6
    assert abs(before["logps/chosen"] - sum(ref["chosen"]) / 4) < 1e-4
    assert one["test"]["logps/chosen"] != before["logps/chosen"]  # trained
    for out, extra in (("lr0", ()), ("simpo-lr0", ("--dpo-loss", "simpo"))):
        _dpo_cpu(dpo_cpu, out, 1, "--lr", "0", "--steps", "1", "--eval-interval", "1", *extra)
        s = json.loads((dpo_cpu / out / "finetune_summary.json").read_text())
        b, t = s["test_before"], s["test"]
        assert b.keys() == t.keys() and b["pairs"] == 4, out
        for k in b:
            assert abs(b[k] - t[k]) < 1e-4, (out, k, b[k], t[k])
    assert s["test_before"]["rewards/chosen"] != 0.0  # SimPO's reward: beta times the mean log-probability


@pytest.mark.slow  # one 2-rank launch: 15-30 s on 2 busy cores
def test_dpo_at_tensor_parallel_2_on_gloo_equals_tp_1(dpo_cpu):
    """Point 4: a full-policy DPO fine-tune at TP 2 on 2 CPU gloo ranks gives TP 1's losses, gradient norms,
    rewards and validation losses within fp32 tolerance (the padded vocabulary's rows masked per rank)."""
    assert "world 2 = dp 1 x tp 2" in _dpo_cpu(dpo_cpu, "tp2", 2, "--tp", "2")
    one, tp2 = _steps(dpo_cpu / "one"), _steps(dpo_cpu / "tp2")
    assert [r["step"] for r in tp2] == [r["step"] for r in one] == list(range(1, 7))
    for a, b in zip(one, tp2, strict=True):
        for k in ("loss", "grad_norm", "logps/chosen", "logps/rejected", "val_loss"):
            assert (a.get(k) is None) == (b.get(k) is None) and b.get(k, 0) == pytest.approx(a.get(k, 0), rel=1e-5), k
        for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert b[k] == pytest.approx(a[k], abs=1e-5), k
        assert b["rewards/accuracies"] == a["rewards/accuracies"] or a["step"] == 1  # step 1: ties at 0


@pytest.mark.slow  # one 2-rank launch: 15-30 s on 2 busy cores
def test_fsdp_full_policy_dpo_on_2_ranks_equals_one_process(dpo_cpu):
    """Point 4: a full-policy DPO fine-tune with FSDP2 on 2 CPU ranks (micro batch 1: the same per-pair
    losses averaged) gives one process's losses, gradient norms, rewards and validation losses (1e-5)."""
    assert "sharded over 2 ranks (FSDP2)" in _dpo_cpu(dpo_cpu, "fsdp", 2, "--fsdp")
    one, fsdp = _steps(dpo_cpu / "one"), _steps(dpo_cpu / "fsdp")
    assert [r["step"] for r in fsdp] == list(range(1, 7))
    for a, b in zip(one, fsdp, strict=True):
        for k in ("loss", "grad_norm", "logps/chosen", "logps/rejected", "val_loss"):
            assert (a.get(k) is None) == (b.get(k) is None) and b.get(k, 0) == pytest.approx(a.get(k, 0), rel=1e-5), k
        for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert b[k] == pytest.approx(a[k], abs=1e-5), k
    summary = json.loads((dpo_cpu / "fsdp" / "finetune_summary.json").read_text())
    assert summary["trainable_parameters"] == summary["total_parameters"] and summary["test"]["pairs"] == 4


@pytest.mark.slow  # the shared fixture; the refusal itself is one process's start (~8 s)
def test_tensor_parallel_on_the_cpu_is_refused_for_a_base_with_dropout(dpo_cpu):
    """megatron-core draws the tensor-parallel ranks' dropout masks from its CUDA RNG tracker: a fine-tune of a
    base with dropout at TP 2 on the CPU stops before it starts, naming why (as pretraining does)."""
    import shutil
    import subprocess

    from conftest import env_with_venv
    from test_finetune_fsdp_cpu import BIN

    shutil.copytree(dpo_cpu / "base", dpo_cpu / "base-dropout")
    cfg_path = dpo_cpu / "base-dropout/checkpoints/run_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["config"]["model"]["hidden_dropout"] = 0.1
    cfg_path.write_text(json.dumps(cfg))
    cmd = [str(BIN / "snakellm"), *CPU_FT, "--out-dir", "dropout", "--tp", "2", "--base", "base-dropout"]
    proc = subprocess.run(cmd, cwd=dpo_cpu, env=env_with_venv(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "tensor parallel size 2 with dropout needs GPUs" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow  # ~3 s (a snakemake dry run): the slow tier (fast-tier budget)
def test_a_lora_sft_reference_and_a_dpo_report_page_in_the_job_graph(workspace):
    """Point 3: dpo.reference naming a LoRA fine-tune: the reference_logprobs job reads that fine-tune's base
    run with its adapter (--model runs/RUN --adapter .../adapter) after it is trained; p-tuning is refused by
    name at the config check. Point 5: a DPO fine-tune's report page is drawn from its own metrics and summary
    (no evaluate_base / evaluate_finetune job, no --base flag: a DPO fine-tune is evaluated in itself)."""
    import shutil

    import yaml

    from snakellm.config.checks import check_dpo
    from snakellm.errors import ConfigError

    shutil.copytree(REPO / "resources", workspace.root / "resources")
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg |= yaml.safe_load((REPO / "config" / "examples" / "tiny-dpo.yaml").read_text())
    chat = yaml.safe_load((REPO / "config" / "examples" / "tiny-chat-finetune.yaml").read_text())
    cfg["sft_data"] |= chat["sft_data"]
    cfg["finetune"]["tiny-chat"] = chat["finetune"]["tiny-chat"] | {"method": "lora"}
    cfg["finetune"]["tiny-dpo"]["dpo"]["reference"] = "tiny-chat"
    workspace.write_config(cfg)
    targets = ("runs/tiny/finetune/tiny-dpo/reference_logprobs.json", "results/report/finetune/tiny/tiny-dpo.html")
    out = workspace.run("-n", "-p", *targets, timeout=120).stdout
    ref = next(x for x in out.splitlines() if "snakellm reference-logprobs" in x)
    assert "--model runs/tiny --adapter runs/tiny/finetune/tiny-chat/adapter" in ref
    assert "rule finetune:" in out and "wildcards: run=tiny, ft=tiny-chat" in out
    assert "report_finetune" in out and "evaluate_finetune" not in out and "evaluate_base" not in out
    page = next(x for x in out.splitlines() if "snakellm report finetune" in x)
    assert "--metrics runs/tiny/finetune/tiny-dpo/metrics.jsonl" in page and "--base" not in page
    dpo = {"loss": "sigmoid", "beta": 0.1, "label_smoothing": 0.0, "reference": "tiny-chat", "policy": "lora"}
    fts = {"tiny-chat": {"method": "ptuning"}}
    with pytest.raises(
        ConfigError, match="'tiny-chat' is not base, adapter-off, a key of runs or import_hf, or a full or LoRA"
    ):
        check_dpo("tiny-dpo", {"dpo": dpo}, {"finetune": fts})
    check_dpo("tiny-dpo", {"dpo": dpo}, {"finetune": {"tiny-chat": {"method": "lora"}}})


@pytest.mark.slow  # ~3 s (snakemake dry runs): the slow tier (fast-tier budget)
def test_sft_then_dpo_starts_from_the_sft_model_in_the_job_graph(workspace):
    """Point 7's SFT then DPO (config/examples/tiny-dpo.yaml): the DPO fine-tune (start: tiny-dpo-sft) trains
    from the full SFT fine-tune's model/, which is its default reference (TRL's: the initial policy) and the
    base of its LoRA exports; its comparison is drawn from its summary. A start that is not a full fine-tune of
    the same run, or on a method other than dpo, is refused naming the key."""
    import shutil

    import yaml

    from snakellm.config.checks import check_start
    from snakellm.errors import ConfigError

    shutil.copytree(REPO / "resources", workspace.root / "resources")
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg |= yaml.safe_load((REPO / "config" / "examples" / "tiny-dpo.yaml").read_text())
    workspace.write_config(cfg)
    d = "runs/tiny/finetune"
    targets = (f"{d}/tiny-dpo/hf_peft/adapter_config.json", f"{d}/tiny-dpo/hf_merged")
    targets += ("runs/tiny/eval/tiny-dpo/comparison.md", "results/report/finetune/tiny/tiny-dpo.html")
    out = workspace.run("-n", "-p", *targets, timeout=120).stdout
    lines = out.splitlines()
    ft = [x for x in lines if " snakellm finetune " in x]
    assert len(ft) == 2 and any(f"--out-dir {d}/tiny-dpo-sft " in x and "--base runs/tiny " in x for x in ft)
    assert any(f"--out-dir {d}/tiny-dpo " in x and f"--base {d}/tiny-dpo-sft/model " in x for x in ft)
    ref = next(x for x in lines if "snakellm reference-logprobs" in x)
    assert f"--model {d}/tiny-dpo-sft/model " in ref and "--adapter" not in ref
    merge = next(x for x in lines if "snakellm lora merge-hf" in x)
    assert f"--base {d}/tiny-dpo-sft/model --adapter {d}/tiny-dpo/adapter" in merge
    assert any(f"--base-model {d}/tiny-dpo-sft/hf " in x for x in lines if "export-peft" in x)
    assert "compare-eval --preference runs/tiny/finetune/tiny-dpo/finetune_summary.json" in out
    page = next(x for x in lines if "snakellm report finetune" in x)
    assert "--comparison runs/tiny/eval/tiny-dpo/comparison.json" in page and "--base" not in page
    fts = cfg["finetune"]
    check_start("tiny-dpo", fts["tiny-dpo"], cfg)
    bad = [
        ({**fts["tiny-dpo"], "start": "nope"}, {}, "'nope' is not another fine-tune"),
        ({**fts["tiny-dpo"], "start": "tiny-dpo"}, {}, "'tiny-dpo' is not another fine-tune"),
        (fts["tiny-dpo"], {"method": "lora"}, "'tiny-dpo-sft' is a lora fine-tune with no model of its own"),
        (fts["tiny-dpo"], {"run": "other"}, "'tiny-dpo-sft' is a fine-tune of run other, this one's is tiny"),
        (
            {**fts["tiny-dpo"], "method": "full"},
            {},
            "'tiny-dpo-sft': only method dpo starts from another fine-tune's model",
        ),
    ]
    for ft_, sft_change, why in bad:
        c = {"finetune": {"tiny-dpo": ft_, "tiny-dpo-sft": fts["tiny-dpo-sft"] | sft_change}}
        with pytest.raises(ConfigError, match="config key finetune.tiny-dpo.start: " + why):
            check_start("tiny-dpo", ft_, c)
    loop = {"a": {"method": "dpo", "run": "r", "start": "b", "dpo": {"policy": "full"}}}
    loop["b"] = loop["a"] | {"start": "a"}
    with pytest.raises(ConfigError, match="go round in a circle"):
        check_start("a", loop["a"], {"finetune": loop})


@pytest.mark.slow  # the shared fixture, then a 2-step LoRA SFT, its merge and two reference passes: 40-50 s
def test_reference_log_probs_of_a_lora_fine_tune_are_its_merged_models(dpo_cpu):
    """Point 3: `snakellm reference-logprobs --model BASE --adapter ADAPTER` gives the log-probabilities of
    `snakellm lora merge`'s model of the same fine-tune (fp32, 1e-4), which differ from the base's."""
    from test_finetune_fsdp_cpu import BIN, _run

    sft = ["finetune", "--base", "base", "--data-dir", "sft", "--method", "lora", "--steps", "2", "--lr", "1e-2"]
    sft += ["--micro-batch-size", "2", "--global-batch-size", "2", "--max-seq-length", "64", "--eval-interval", "2"]
    _run([str(BIN / "snakellm"), *sft, "--device", "cpu", "--no-progress", "--out-dir", "lora"], dpo_cpu)
    merge = ["lora", "merge", "--base", "base", "--adapter", "lora/adapter", "--out", "merged", "--device", "cpu"]
    _run([str(BIN / "snakellm"), *merge], dpo_cpu)
    ref = ["reference-logprobs", "--data-dir", "pref", "--max-seq-length", "64", "--device", "cpu"]
    _run([str(BIN / "snakellm"), *ref, "--model", "base", "--adapter", "lora/adapter", "--out", "a.json"], dpo_cpu)
    _run([str(BIN / "snakellm"), *ref, "--model", "merged", "--out", "m.json"], dpo_cpu)
    a, m, base = (json.loads((dpo_cpu / f).read_text()) for f in ("a.json", "m.json", "ref.json"))
    assert a["adapter"] == "lora/adapter" and a["splits"].keys() == m["splits"].keys() == {
        "train",
        "validation",
        "test",
    }
    for split in a["splits"]:
        for side in ("chosen", "rejected"):
            assert a["splits"][split][side] == pytest.approx(m["splits"][split][side], abs=1e-4)
    assert max(abs(x - y) for x, y in zip(a["splits"]["train"]["chosen"], base["splits"]["train"]["chosen"])) > 1e-3
