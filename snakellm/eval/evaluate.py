"""``snakellm evaluate``: generation on a test split, scored with NeMo's and SQuAD's metrics.

For each ``{input, output[, answers]}`` example (prepare-sft's test split) the
model generates from the prompt (the same template, BOS/EOS and truncation as
in training) for up to ``--tokens-to-generate`` tokens or EOD, with the
KV-cached engine that ``snakellm generate`` and the server use, and NeMo's
inference settings (``greedy`` by default; temperature, top-k/p, repetition
penalty, ``min_tokens_to_generate``, ``end_strings`` and a seed otherwise).
One process, tensor parallel 1: a model that was tuned with tp > 1 is read back
whole (dist_checkpointing reshards it).

As NeMo's ``MegatronGPTSFTModel`` test pass does, ``pred = decode(generated
ids)`` and ``label = decode(answer ids)`` are compared by exact string match
(raw equality), reported under NeMo's logged names: ``test_exact_string_match``
and ``test_loss`` (the token-mean loss on the answer tokens given the prompt,
teacher forced). SQuAD's normalised exact match and F1 take the best over
every gold answer (``squad_exact_match``, ``squad_f1``).

The model is the base run alone or with what ``snakellm finetune`` wrote:
``--adapter DIR`` (LoRA), ``--prompt DIR`` (p-tuning) or a full fine-tune's
``model/`` directory as ``--base``. Outputs in ``--out-dir``: ``metrics.json``;
``predictions.jsonl`` (``{input, pred, label, answers}``); and NeMo's own
``predictions_test_dataloader0_inputs_preds_labels.jsonl`` (what
``write_predictions_to_file`` with ``output_file_path_prefix: predictions``
writes for an unnamed test set: ``{input, pred, label}`` per line).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from snakellm.io.atomic import atomic_group

# NeMo: f"{output_file_path_prefix}_{mode}_dataloader{idx}_inputs_preds_labels.jsonl"
NEMO_PREDICTIONS = "predictions_test_dataloader0_inputs_preds_labels.jsonl"
OUTPUTS = ("metrics.json", "predictions.jsonl", NEMO_PREDICTIONS)
DECODING = (
    "tokens_to_generate",
    "min_tokens_to_generate",
    "greedy",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "end_strings",
    "seed",
)


def sampling_params(a: argparse.Namespace, room: int, index: int) -> Any:
    """The engine's SamplingParams from the decoding settings (a seed per prompt: any batch, same draws)."""
    from snakellm.serve.generate import SamplingParams

    return SamplingParams(
        max_new_tokens=room,
        min_new_tokens=min(a.min_tokens_to_generate, room),
        greedy=a.greedy,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        repetition_penalty=a.repetition_penalty,
        end_strings=tuple(a.end_string or ()),
        seed=a.seed + index,
    )


def generate_answers(gpt, arch: dict, tok, prompts: list[list[int]], a, seq: int, extra) -> list[list[int]]:
    """Answers by the serving engine (snakellm.serve.engine, continuous batching), EOD excluded.

    A LoRA adapter is merged into the weights first (the merged model computes what base + adapter
    computes); a p-tuning prompt table goes to the decoder, which puts it at each prompt's first
    positions. Each prompt gets the tokens that fit after it in the model's sequence
    (``--tokens-to-generate`` or less for a context that fills it); up to ``--batch-size`` rows
    decode together, and a finished row's place goes to the next prompt at the next step.
    """
    from snakellm.finetune.lora import LoRAAdapters, merge
    from snakellm.serve.engine import Engine, EngineSettings, Request

    if isinstance(extra, LoRAAdapters):
        merge(gpt, extra)
    virtual = extra.prompt().detach() if extra is not None and hasattr(extra, "prompt") else None
    from snakellm.serve.generate import Generator

    engine = Engine(Generator(gpt, arch, tok, virtual=virtual), EngineSettings(max_batch=a.batch_size))
    out: list[list[int]] = [[] for _ in prompts]
    budget = [min(a.tokens_to_generate, seq - len(p)) for p in prompts]
    reqs = {
        i: engine.add(Request(list(p), sampling_params(a, room, i)))
        for i, (p, room) in enumerate(zip(prompts, budget, strict=True))
        if room > 0
    }
    while engine.has_work():
        engine.step()
    for i, r in reqs.items():
        out[i] = r.ids[:-1] if r.finish_reason == "eod" else r.ids
    return out


def decoding(a: argparse.Namespace) -> dict[str, Any]:
    """The decoding settings as the config spells them (metrics.json records what produced the predictions)."""
    return {k: list(a.end_string or []) if k == "end_strings" else getattr(a, k) for k in DECODING}


def cut_at_end_strings(text: str, ends: list[str]) -> str:
    """The answer up to the first end string (NeMo strips its end_strings from the response as well)."""
    cut = min((text.find(e) for e in ends if e and e in text), default=-1)
    return text if cut < 0 else text[:cut]


def answer_loss(rt, gpt, exs: list, eod: int, batch_size: int) -> float:
    """NeMo's ``test_loss``: the answer tokens' mean loss given their prompts (teacher forcing)."""
    from snakellm.finetune import dataset as ds

    torch = rt.torch
    tot = torch.zeros(2, dtype=torch.float64)
    gpt.eval()
    with torch.no_grad():
        for k in range(0, len(exs), batch_size):
            b = ds.collate(exs[k : k + batch_size], eod, True)
            b = {kk: v.to(rt.device) for kk, v in b.items()}
            per_tok = gpt(b["tokens"], b["position_ids"], None, labels=b["labels"])
            m = b["loss_mask"]
            tot += torch.tensor([float((per_tok.float() * m).sum()), float(m.sum())], dtype=torch.float64)
    return float(tot[0] / tot[1].clamp(min=1))


def _encoder(a: argparse.Namespace, tok, seq: int, conf: dict | None, virtual: int):
    """The training run's example encoder: an adapter/prompt's own settings win over the flags."""
    from snakellm.finetune import dataset as ds

    ex_cfg = (conf or {}).get("examples") or {}
    return ds.Encoder(
        tok,
        seq + 1,
        ex_cfg.get("template", a.template),
        ex_cfg.get("add_bos", a.add_bos),
        ex_cfg.get("add_eos", a.add_eos),
        ex_cfg.get("truncation_method", a.truncation_method),
        reserved=virtual,
        truncation_field=ex_cfg.get("truncation_field", a.truncation_field),
    ), ex_cfg.get("add_eos", a.add_eos)


def _chat_examples(a: argparse.Namespace, tok_info: dict, tok, seq: int, conf: dict | None, records: list[dict]):
    """Chat test records: the prompt is the conversation without its last assistant turn plus the generation
    prompt; the reference is that turn's content; the template's end-of-turn text ends a generated reply.
    The loss is the last turn's (``last_assistant``), teacher forced. The adapter's own settings win."""
    from snakellm.finetune import conversations
    from snakellm.finetune import dataset as ds

    ex_cfg = (conf or {}).get("examples") or {}
    template = ex_cfg.get("chat_template", a.chat_template)
    enc = conversations.chat_encoder(tok_info, tok, template, seq + 1, "last_assistant")
    exs, prompts, labels, ends = [], [], [], set()
    for r in records:
        where = f"{a.test}:{r.get(ds.LINE, '?')}"
        e = enc.encode(r, where)
        if e is None:
            raise ds.SFTFormatError(f"{where}: the conversation's last turn does not fit {seq} tokens")
        ids, reply, end, text = enc.prompt_and_reply(r, where)
        r["input"] = text  # predictions.jsonl's input: the rendered prompt
        exs.append(e)
        prompts.append(ids)
        labels.append(reply)
        ends.add(end)
    golds = [[lab] for lab in labels]
    turn_end = next(iter(ends)) if len(ends) == 1 else None
    return enc, exs, prompts, labels, golds, turn_end


def evaluate(a: argparse.Namespace) -> dict:
    from snakellm import models
    from snakellm.finetune import artifacts, conversations, runtime
    from snakellm.finetune import dataset as ds
    from snakellm.finetune.metrics import exact_string_match, squad_scores

    rt = runtime.start(a.device, 1, a.threads)
    try:
        bf16 = (a.precision == "bf16") or (a.precision == "auto" and rt.cuda)
        from snakellm.models.loading import describe_run
        from snakellm.serve.generate import check_fits_one_gpu, gpu_capacity

        info = describe_run(a.base)
        check_fits_one_gpu(info["arch"], info["padded_vocab_size"], 2 if bf16 else 4, gpu_capacity(rt.device))
        base = models.load(a.base, device=rt.device, bf16=bf16, seq_length=a.max_seq_length)
        gpt, arch = base.model, base.arch
        seq = a.max_seq_length or arch["seq_length"]
        tok = runtime.load_tokenizer(base.tokenizer)  # the tokenizer the run carries
        virtual, conf, extra = artifacts.attach(rt.device, gpt, arch, a.adapter, a.prompt)
        records = ds.read_jsonl(a.test)[: a.limit or None]
        ends = list(a.end_string or [])
        if any(conversations.is_conversation(r) for r in records):
            enc, exs, prompts, labels, golds, turn_end = _chat_examples(a, base.tokenizer, tok, seq, conf, records)
            ends += [turn_end] if turn_end else []
        else:
            enc, add_eos = _encoder(a, tok, seq, conf, virtual)
            exs = enc.encode_all(records)
            warning = ds.truncation_warning(a.test, exs, enc)
            if warning:
                print(f"snakellm evaluate: {warning}", file=sys.stderr)
            eos = [tok.eod_id] if add_eos else []
            labels = [
                tok.decode(e.answer[: len(e.answer) - 1] if eos and e.answer[-1:] == eos else e.answer) for e in exs
            ]
            golds = [r.get("answers") or [r["output"]] for r in records]
            prompts = [e.context for e in exs]
        for e in exs:
            e.context = [int(tok.eod_id)] * virtual + e.context
            if e.mask is not None:
                e.mask = [0] * virtual + e.mask
        prompts = [[int(tok.eod_id)] * virtual + p for p in prompts]
        loss = answer_loss(rt, gpt, exs, tok.eod_id, a.batch_size)
        t0 = time.perf_counter()
        gen = generate_answers(gpt, arch, tok, prompts, a, seq, extra)
        gen_s = time.perf_counter() - t0
        preds = [cut_at_end_strings(tok.decode(g), ends) for g in gen]
        metrics = {
            "model": a.label or ("lora" if a.adapter else "ptuning" if a.prompt else "base"),
            "checkpoint": str(base.checkpoint),
            "adapter": a.adapter,
            "prompt": a.prompt,
            "test": str(a.test),
            "examples": len(exs),
            "test_exact_string_match": exact_string_match(preds, labels),
            **squad_scores(preds, golds),
            "test_loss": loss,
            "decoding": decoding(a),
            "encode": enc.stats.as_dict(),
            "generation": {  # the engine's speed on this split (not a result: it varies with the machine)
                "seconds": round(gen_s, 3),
                "examples_per_s": round(len(exs) / max(gen_s, 1e-9), 2),
                "new_tokens": sum(map(len, gen)),
                "peak_gpu_memory_gib": (round(rt.torch.cuda.max_memory_allocated() / 2**30, 2) if rt.cuda else None),
            },
        }
        if rt.rank == 0:
            write_outputs(Path(a.out_dir), metrics, records, preds, labels, golds)
        return metrics
    finally:
        runtime.stop()


def write_outputs(
    out: Path,
    metrics: dict,
    records: list[dict],
    preds: list[str],
    labels: list[str],
    golds: list[list[str]],
) -> None:
    """metrics.json, our predictions.jsonl and NeMo's predictions file, all three or none (atomic)."""
    rows = list(zip(records, preds, labels, golds, strict=True))
    with atomic_group(*(out / f for f in OUTPUTS)) as (m_tmp, p_tmp, n_tmp):
        p_tmp.write_text(
            "".join(
                json.dumps({"input": r["input"], "pred": p, "label": lab, "answers": g}, ensure_ascii=False) + "\n"
                for r, p, lab, g in rows
            ),
            encoding="utf-8",
        )
        # NeMo writes json.dumps({'input': i, 'pred': p, 'label': l}) per line (ASCII escapes, its default)
        n_tmp.write_text(
            "".join(json.dumps({"input": r["input"], "pred": p, "label": lab}) + "\n" for r, p, lab, _ in rows)
        )
        m_tmp.write_text(json.dumps(metrics, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
