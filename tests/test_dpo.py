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
