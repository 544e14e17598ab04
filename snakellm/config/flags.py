"""The settings flags of a rule's command line, from its config section (torch-free).

Every rule passes its settings as flags derived from the section's dataclass
(:mod:`snakellm.config.sections`) by :func:`snakellm.config.settings.to_flags`,
so a setting has one name, one default and one spelling on the command line,
and the rule reruns exactly when one of its own settings changes (they are its
params). The sections that need more than one dataclass, or a value the config
implies (a trained tokenizer's model file), are put together here.
"""

from __future__ import annotations

import hashlib
from typing import Any

from snakellm.config import sections as S
from snakellm.config.settings import to_flags


def join(*parts: str) -> str:
    """Flag strings joined with single spaces (empty ones left out)."""
    return " ".join(p for p in parts if p)


def tokenizer_files(name: str, spec: dict[str, Any]) -> list[str]:
    """The files a tokenizer is loaded from (a trained one: the train_tokenizer rule's model)."""
    if spec["kind"] == "gpt2-bpe":
        return [spec["vocab_file"], spec["merges_file"]]
    if spec["kind"] == "huggingface":
        return [spec["tokenizer_file"]]
    return [spec.get("model_file") or f"tokenizers/{name}/tokenizer.model"]


def tokenizer_flags(name: str, spec: dict[str, Any]) -> str:
    """`snakellm tokenize` tokenizer flags: only this tokenizer's entry, so editing another reruns nothing."""
    values = dict(spec)
    if spec["kind"] == "sentencepiece":
        values["model_file"] = tokenizer_files(name, spec)[0]
    return to_flags(S.TokenizerSettings, values)


def train_tokenizer_flags(spec: dict[str, Any]) -> str:
    """`snakellm train-tokenizer` settings: any change retrains (and re-tokenizes with) this tokenizer only."""
    train = spec["train"]
    return join(
        to_flags(S.TokenizerSettings, {"vocab_size": spec["vocab_size"]}),
        to_flags(S.TokenizerTrainSettings, train),
        to_flags(S.SampleSettings, train.get("sample", {})),
    )


def finetune_flags(ft: dict[str, Any]) -> str:
    """Every `snakellm finetune` setting, spelled out: the rule reruns exactly when one changes.

    Only the chosen method's options are passed (editing the LoRA block of a
    p-tuning fine-tune reruns nothing); the threads are the job's own.
    """
    kind = ft.get("dpo", {}).get("policy", "lora") if ft["method"] == "dpo" else ft["method"]
    method = {"lora": (S.LoraSettings, "lora"), "ptuning": (S.PtuningSettings, "ptuning")}.get(kind)
    return join(
        to_flags(S.FinetuneSettings, ft),
        to_flags(method[0], ft.get(method[1], {})) if method else "",
        to_flags(S.DpoSettings, ft.get("dpo", {})) if ft["method"] == "dpo" else "",
        to_flags(S.ExamplesSettings, ft.get("examples", {})),
        to_flags(S.FinetuneTrainSettings, ft["train"]),
        to_flags(S.FinetuneParallelSettings, ft.get("parallel", {})),
    )


def reference_flags(ft: dict[str, Any], model: str, adapter: str | None = None) -> str:
    """`snakellm reference-logprobs` settings: the reference (a LoRA fine-tune's: its base and adapter), the
    pairs' tokenization, the fine-tune's sequence length and precision; nothing else of the fine-tune (a new
    beta or learning rate reuses the file)."""
    import shlex

    dpo, examples = ft.get("dpo", {}), ft.get("examples", {})
    seq = examples.get("max_seq_length")
    precision = {"fp8": "bf16"}.get(ft["train"].get("precision", "auto"), ft["train"].get("precision", "auto"))
    return join(
        shlex.join(["--model", model]),
        shlex.join(["--adapter", adapter]) if adapter else "",
        to_flags(S.DpoSettings, {k: dpo.get(k) for k in S.DPO_TOKENIZATION}),
        f"--max-seq-length {int(seq)}" if seq else "",
        shlex.join(["--chat-template", examples["chat_template"]]) if examples.get("chat_template") else "",
        f"--precision {precision}",
    )


def tracking(*layers: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The tracking settings of a job: the global ``tracking``, then a run's or fine-tune's (keys it sets win)."""
    out: dict[str, dict[str, Any]] = {"wandb": {}, "mlflow": {}}
    for layer in layers:
        for backend in out:
            out[backend].update({k: v for k, v in ((layer or {}).get(backend) or {}).items() if v is not None})
    return out


def tracked(*layers: dict[str, Any] | None) -> bool:
    """Whether the layers configure a tracker: a W&B project (not disabled) or an MLflow URI or experiment."""
    t = tracking(*layers)
    w, m = t["wandb"], t["mlflow"]
    return bool(w.get("project") and w.get("mode") != "disabled" or m.get("tracking_uri") or m.get("experiment"))


def tracking_flags(*layers: dict[str, Any] | None) -> str:
    """`--wandb-*` and `--mlflow-*` flags of a job (:func:`tracking`); empty when nothing is tracked."""
    t = tracking(*layers)
    return join(to_flags(S.WandbSettings, t["wandb"]), to_flags(S.MlflowSettings, t["mlflow"]))


def evaluate_flags(ft: dict[str, Any]) -> str:
    """`snakellm evaluate` settings: the fine-tune's example building (as trained) and its evaluate block."""
    return join(
        to_flags(S.ExamplesSettings, ft.get("examples", {}), exclude=S.PACKING_ONLY),
        to_flags(S.EvaluateSettings, ft.get("evaluate", {})),
    )


def base_eval_key(ft: dict[str, Any]) -> str:
    """The base model's evaluation for a fine-tune: named by what changes its result, not by the fine-tune.

    The base model is evaluated once per (run, data set, example and decoding
    settings) and shared by every fine-tune with the same three, in
    ``runs/{run}/eval/base/{data}/{key}/``: ``key`` is the first 8 hex digits of
    the sha256 of the evaluation's flags (the same flags give the same key).
    """
    return hashlib.sha256(evaluate_flags(ft).encode()).hexdigest()[:8]


CURATE_JUDGE_KEYS = ("languages", "language_threshold", "language_model")


def curate_flags(curate: dict[str, Any], filters: bool = True) -> str:
    """`snakellm curate-signatures` flags of a source's ``curate`` section (defaults filled); ``filters=False``:
    only the dedup settings (`snakellm curate-buckets`).

    Each filter is ``--filter NAME`` and each of its settings ``--filter-setting NAME.KEY=JSON``;
    near dedup is ``--near`` and the NearDupSettings flags, or ``--no-near``.
    """
    import json
    import shlex

    parts = [to_flags(S.CurateSettings, curate, exclude=("index",) if filters else ("index", *CURATE_JUDGE_KEYS))]
    near = curate.get("near")
    parts.append("--no-near" if near is None else "--near " + to_flags(S.NearDupSettings, near))
    if filters:
        words: list[str] = []
        for name, values in sorted((curate.get("filters") or {}).items()):
            words += ["--filter", name]
            for k, v in sorted((values or {}).items()):
                words += ["--filter-setting", f"{name}.{k}={json.dumps(v)}"]
        parts.append(shlex.join(words))
    return join(*parts)
