"""Chat templates (snakellm.finetune.chat_template) against real transformers and TRL.

The render and the token ids equal ``AutoTokenizer.apply_chat_template``'s for real templates
(Qwen 2.5's ChatML and Llama 3's as TRL ships them, our built-ins); without generation markers
the trained tokens are exactly each assistant content plus its end-of-turn token (and the
newline after it); with markers the mask equals transformers' ``return_assistant_tokens_mask``
and TRL's ``assistant_only_loss`` masks.
"""

from __future__ import annotations

import json

import pytest
from chat_helpers import chat_tokenizer_dir, trl_template

from snakellm.finetune import chat_template as ct

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [
        {"role": "system", "content": "You are terse. Réponds en français si besoin."},
        {"role": "user", "content": "Hello, who are you?"},
        {"role": "assistant", "content": "An assistant. user: is a role word; so is assistant."},
        {"role": "user", "content": "Say the end token."},
        {"role": "assistant", "content": "It is written <|im_end|> or <|eot_id|> or </s>, 終わり 🐍."},
        {"role": "user", "content": "Thanks\n\nbye"},
        {"role": "assistant", "content": "  Bye!\n"},
    ],
    [
        {"role": "user", "content": "Two lines:\nfirst"},
        {"role": "assistant", "content": "second\nthird"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "ok"},
    ],
]
END = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "mistral": "</s>"}


def _hf(tmp_path, template, family):
    d = chat_tokenizer_dir(tmp_path / family, template, family)
    return d, transformers.AutoTokenizer.from_pretrained(str(d))


def _ours(d, setting=None):
    from snakellm.tokenize import encoders

    cfg = json.loads((d / "tokenizer_config.json").read_text())
    tok = encoders.load("huggingface", tokenizer_file=str(d / "tokenizer.json"), eod=cfg["eos_token"])
    return ct.load_template(setting, d), ct.ChatTokenizer(tok, d)


def _trained_text(hf, ids, mask):
    return hf.decode([t for t, m in zip(ids, mask, strict=True) if m])


@pytest.mark.slow  # transformers' tokenizers and templates: ~1-2 s each; the fast tier's 90 s has no room
@pytest.mark.parametrize(
    ("name", "family"), [("qwen2_5", "chatml"), ("llama3", "llama3"), ("chatml", "chatml"), ("mistral", "mistral")]
)
def test_render_ids_and_unmarked_mask(tmp_path, name, family):
    text = ct.BUILTIN[name] if name in ct.BUILTIN and name != "llama3" else trl_template(name)
    d, hf = _hf(tmp_path, text, family)
    template, tok = _ours(d)
    assert not template.has_generation_markers
    for conv in CONVERSATIONS:
        if family == "mistral" and conv[0]["role"] == "system":
            conv = conv[1:]
        for gen in (False, True):
            assert template.render(conv, add_generation_prompt=gen) == hf.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=gen
            )
        ids, mask = ct.encode_chat(template, tok, conv)
        assert ids == hf.apply_chat_template(conv, tokenize=True, return_dict=False)
        # the trained tokens: every assistant content, then its end-of-turn token (a newline after it allowed)
        want = ""
        for m in conv:
            if m["role"] == "assistant":
                body = m["content"].strip() if family == "llama3" else m["content"]
                want += body + END[family] + ("\n" if family == "chatml" else "")
        assert _trained_text(hf, ids, mask) == want
        # one run of trained tokens per assistant turn (so never a header or a user turn between)
        runs = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
        assert runs == sum(m["role"] == "assistant" for m in conv)
        last_ids, last = ct.encode_chat(template, tok, conv, "last_assistant")
        final = next(m for m in reversed(conv) if m["role"] == "assistant")
        body = final["content"].strip() if family == "llama3" else final["content"]
        assert last_ids == ids and _trained_text(hf, ids, last) == body + END[family] + ("\n" * (family == "chatml"))
        assert ct.encode_chat(template, tok, conv, "all")[1] == [1] * len(ids)


@pytest.mark.slow  # TRL's and transformers' templates: ~1 s each; the fast tier's 90 s has no room
@pytest.mark.parametrize(("plain", "marked", "family"), [("llama3", "llama3_training", "llama3"),
                                                         ("qwen2_5", "qwen2_5_training", "chatml")])  # fmt: skip
def test_marked_templates_match_transformers_and_trl(tmp_path, plain, marked, family):
    d, hf = _hf(tmp_path, trl_template(marked), family)
    template, tok = _ours(d)
    assert template.has_generation_markers
    plain_t = ct.ChatTemplate(trl_template(plain), plain, template.specials)
    for conv in CONVERSATIONS:
        ids, mask = ct.encode_chat(template, tok, conv)
        out = hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == out["input_ids"] and mask == out["assistant_masks"]
        plain_ids, plain_mask = ct.encode_chat(plain_t, tok, conv)
        assert plain_ids == ids
        if family == "llama3":  # the marker spans are what the prefix search finds
            assert plain_mask == mask
        else:  # Qwen's markers also take the newline after 'assistant' (a header's): ours does not
            diff = [i for i, (a, b) in enumerate(zip(plain_mask, mask, strict=True)) if a != b]
            assert all(hf.decode([ids[i]]) == "\n" and mask[i] == 1 for i in diff)
            assert len(diff) == sum(m["role"] == "assistant" for m in conv)


@pytest.mark.slow  # imports torch and TRL's trainer stack (~15 s)
def test_trl_sft_tokenization_gives_the_same_mask(tmp_path):
    """TRL's SFTTrainer dataset preparation with assistant_only_loss: its labels are ours."""
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    d, hf = _hf(tmp_path, trl_template("llama3_training"), "llama3")
    template, tok = _ours(d)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=len(hf),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )  # fmt: skip
    )
    ds = datasets.Dataset.from_list([{"messages": c} for c in CONVERSATIONS])
    args = trl.SFTConfig(output_dir=str(tmp_path / "o"), assistant_only_loss=True, report_to=[], max_length=None,
                         use_cpu=True, bf16=False)  # fmt: skip
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=hf)
    for row, conv in zip(trainer.train_dataset, CONVERSATIONS, strict=True):
        ids, mask = ct.encode_chat(template, tok, conv)
        assert row["input_ids"] == ids
        # TRL folds its assistant mask into Hugging Face labels (-100 where untrained)
        assert row["labels"] == [t if m else -100 for t, m in zip(ids, mask, strict=True)]
        assert 0 < sum(mask) < len(mask)


def test_template_choice_and_errors(tmp_path):
    own = chat_tokenizer_dir(tmp_path / "own", ct.BUILTIN["chatml"])
    assert ct.load_template(None, own).source.endswith("tokenizer_config.json")
    (own / "chat_template.jinja").write_text(ct.BUILTIN["llama3"])
    assert ct.load_template(None, own).text == ct.BUILTIN["llama3"]  # transformers 5's file wins
    assert ct.load_template("mistral", own).text == ct.BUILTIN["mistral"]
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert ct.load_template(str(f), own).render([{"role": "user", "content": "x"}]) == "x"
    bare = chat_tokenizer_dir(tmp_path / "bare", None)
    with pytest.raises(ct.ChatTemplateError, match=r"examples\.chat_template"):
        ct.load_template(None, bare)
    with pytest.raises(ct.ChatTemplateError, match=r"examples\.chat_template 'nope'"):
        ct.load_template("nope", bare)
    mistral = ct.load_template("mistral", bare)
    with pytest.raises(ct.ChatTemplateError, match="alternate"):
        mistral.render([{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}])


@pytest.mark.slow  # 1.3 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
def test_unlocatable_turn_is_refused_never_all_ones(tmp_path):
    """A template that places text by what comes later (here: the turn count at the top) cannot be split."""
    tricky = (
        "{{ messages | length }} turns\n{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    d = chat_tokenizer_dir(tmp_path / "t", tricky)
    template, tok = _ours(d)
    with pytest.raises(ct.ChatTemplateError, match="chat template .*" + str(d) + ".*cannot locate assistant turn 1"):
        ct.encode_chat(template, tok, CONVERSATIONS[0])
    rewrites = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
    t2 = ct.ChatTemplate(rewrites, "upper.jinja")
    with pytest.raises(ct.ChatTemplateError, match="upper.jinja.*content does not appear"):
        t2.assistant_spans(CONVERSATIONS[2])


@pytest.mark.slow  # 1.5 s of CPU, among the fast tier's slowest (the tier ran 76-89 s of its 90 s budget)
def test_tokenizer_without_tokenizer_json(tmp_path):
    """GPT-2 BPE files (no tokenizer.json): control tokens split out, offsets from decoding; the same ids and mask."""
    from chat_helpers import CONTROL, GPT2

    from snakellm.tokenize import encoders

    d, hf = _hf(tmp_path, ct.BUILTIN["chatml"], "chatml")
    tok = encoders.load("gpt2-bpe", vocab_file=str(GPT2 / "vocab.json"), merges_file=str(GPT2 / "merges.txt"))
    template = ct.load_template(None, d)
    plain = ct.ChatTokenizer(tok, None, specials=CONTROL)
    plain._ids = {w: hf.convert_tokens_to_ids(w) for w in CONTROL}  # what the run's vocabulary would hold
    fast = ct.ChatTokenizer(tok, d)
    for conv in CONVERSATIONS:
        assert ct.encode_chat(template, plain, conv) == ct.encode_chat(template, fast, conv)


def test_sentencepiece_offsets_train_exactly_the_replies(tmp_path):
    """A SentencePiece run (trained here, no tokenizer.json): pieces' own byte spans give the mask."""
    from hf_helpers import train_spm

    from snakellm.tokenize import encoders

    tok = encoders.load("sentencepiece", model_file=str(train_spm(tmp_path, 600)))
    from chat_helpers import ROOT

    plain = (ROOT / "resources" / "chat" / "plain.jinja").read_text()
    t = ct.ChatTemplate(plain, "plain.jinja", {"eos_token": tok.eod_token})
    conv = [{"role": "system", "content": "Count on."}, {"role": "user", "content": "Kiyo counts four"},
            {"role": "assistant", "content": "five"}, {"role": "user", "content": "and then?"},
            {"role": "assistant", "content": "six words"}]  # fmt: skip
    ids, mask = ct.encode_chat(t, ct.ChatTokenizer(tok), conv)
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(trained).replace(" ", "") == "fivesixwords"
    assert trained.count(tok.eod_id) == 2 and ids.count(tok.eod_id) == 2
    assert tok._sp.encode("five")[-1] in trained
