"""``snakellm evaluate``: greedy generation on a test split, NeMo's and SQuAD's metrics.

For each ``{input, output[, answers]}`` example (prepare-sft's test split) the
model generates greedily from the prompt (the same template, BOS/EOS and
truncation as in training) for up to ``--tokens-to-generate`` tokens or EOD,
with the KV-cached engine that ``snakellm generate`` and the server use. One
process, tensor parallel 1: a model that was tuned with tp > 1 is read back
whole (dist_checkpointing reshards it).
Then, as NeMo's ``MegatronGPTSFTModel`` test pass does,
``pred = decode(generated ids)`` and ``label = decode(answer ids)`` are compared
by ``exact_string_match`` (raw equality); SQuAD's normalised exact match and F1
take the best over every gold answer; ``answer_only_loss`` is the token-mean
loss on the answer tokens given the prompt (teacher forcing).

The model is the base run alone or with what ``snakellm finetune`` wrote:
``--adapter DIR`` (LoRA), ``--prompt DIR`` (p-tuning) or a full fine-tune's
``model/`` directory as ``--base``. Outputs: ``metrics.json`` and
``predictions.jsonl`` (``{input, pred, label, answers}`` per example, NeMo's
``*_inputs_preds_labels.jsonl`` fields plus the gold list).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from snakellm.io.atomic import atomic_group


def generate_answers(gpt, arch: dict, tok, prompts: list[list[int]], a, seq: int, extra) -> list[list[int]]:
    """Greedy answers by the serving engine (snakellm.serve.engine, continuous batching), EOD excluded.

    A LoRA adapter is merged into the weights first (the merged model computes what base + adapter
    computes); a p-tuning prompt table goes to the decoder, which puts it at each prompt's first
    positions. Each prompt gets the tokens that fit after it in the model's sequence
    (``--tokens-to-generate`` or less for a context that fills it); up to ``--batch-size`` rows
    decode together, and a finished row's place goes to the next prompt at the next step.
    """
    from snakellm.finetune.lora import LoRAAdapters, merge
    from snakellm.serve.engine import Engine, EngineSettings, Request
    from snakellm.serve.generate import Generator, SamplingParams

    if isinstance(extra, LoRAAdapters):
        merge(gpt, extra)
    virtual = extra.prompt().detach() if extra is not None and hasattr(extra, "prompt") else None
    engine = Engine(Generator(gpt, arch, tok, virtual=virtual), EngineSettings(max_batch=a.batch_size))
    out: list[list[int]] = [[] for _ in prompts]
    budget = [min(a.tokens_to_generate, seq - len(p)) for p in prompts]
    reqs = {
        i: engine.add(Request(list(p), SamplingParams(max_new_tokens=room, greedy=True)))
        for i, (p, room) in enumerate(zip(prompts, budget, strict=True))
        if room > 0
    }
    while engine.has_work():
        engine.step()
    for i, r in reqs.items():
        out[i] = r.ids[:-1] if r.finish_reason == "eod" else r.ids
    return out


def evaluate(a: argparse.Namespace) -> dict:
    from snakellm import models
    from snakellm.finetune import artifacts, runtime
    from snakellm.finetune import dataset as ds
    from snakellm.finetune.metrics import exact_string_match, squad_scores

    rt = runtime.start(a.device, 1, a.threads)
    torch = rt.torch
    try:
        bf16 = (a.precision == "bf16") or (a.precision == "auto" and rt.cuda)
        base = models.load(a.base, device=rt.device, bf16=bf16, seq_length=a.max_seq_length)
        gpt, arch, ck = base.model, base.arch, base.checkpoint
        seq = a.max_seq_length or arch["seq_length"]
        tok = runtime.load_tokenizer(base.tokenizer)  # the tokenizer the run carries
        virtual, conf, extra = artifacts.attach(rt.device, gpt, arch, a.adapter, a.prompt)
        ex_cfg = (conf or {}).get("examples") or {}
        template = ex_cfg.get("template", a.template)
        enc = ds.Encoder(
            tok,
            seq + 1,
            template,
            ex_cfg.get("add_bos", a.add_bos),
            ex_cfg.get("add_eos", a.add_eos),
            ex_cfg.get("truncation_method", a.truncation_method),
            reserved=virtual,
        )
        records = ds.read_jsonl(a.test)
        if a.limit:
            records = records[: a.limit]
        exs = enc.encode_all(records)
        for e in exs:
            e.context = [int(tok.eod_id)] * virtual + e.context

        eos = [] if not ex_cfg.get("add_eos", a.add_eos) else [tok.eod_id]
        labels = [
            tok.decode(e.answer[: len(e.answer) - len(eos)] if eos and e.answer[-1:] == eos else e.answer) for e in exs
        ]
        golds = [r.get("answers") or [r["output"]] for r in records]
        # answer-only loss, teacher forced
        tot = torch.zeros(2, dtype=torch.float64)
        gpt.eval()
        with torch.no_grad():
            for k in range(0, len(exs), a.batch_size):
                b = ds.collate(exs[k : k + a.batch_size], tok.eod_id, True)
                b = {kk: v.to(rt.device) for kk, v in b.items()}
                per_tok = gpt(b["tokens"], b["position_ids"], None, labels=b["labels"])
                m = b["loss_mask"]
                tot += torch.tensor([float((per_tok.float() * m).sum()), float(m.sum())], dtype=torch.float64)
        gen = generate_answers(gpt, arch, tok, [e.context for e in exs], a, seq, extra)
        preds = [tok.decode(g) for g in gen]
        metrics = {
            "model": a.label or ("lora" if a.adapter else "ptuning" if a.prompt else "base"),
            "checkpoint": str(ck),
            "adapter": a.adapter,
            "prompt": a.prompt,
            "examples": len(exs),
            "exact_string_match": exact_string_match(preds, labels),
            **squad_scores(preds, golds),
            "answer_only_loss": float(tot[0] / tot[1].clamp(min=1)),
            "tokens_to_generate": a.tokens_to_generate,
            "context_truncated": enc.stats.context_truncated,
        }
        if rt.rank == 0:
            out = Path(a.out_dir)
            with atomic_group(out / "predictions.jsonl", out / "metrics.json") as (p_tmp, m_tmp):
                p_tmp.write_text(
                    "".join(
                        json.dumps({"input": r["input"], "pred": p, "label": lab, "answers": g}, ensure_ascii=False)
                        + "\n"
                        for r, p, lab, g in zip(records, preds, labels, golds, strict=False)
                    ),
                    encoding="utf-8",
                )
                m_tmp.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        return metrics
    finally:
        runtime.stop()
