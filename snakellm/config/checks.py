"""Cross-field config checks: keys checked against each other, before any job runs.

JSON-schema validation (:mod:`snakellm.config.validate`) checks each key alone;
these check what one key says about another (a fine-tune's base run exists, an
export can pack its run's tokenizer, an import's directory is a Hugging Face
model). Each raises :class:`~snakellm.errors.ConfigError` naming the key, so
``rules/common.smk`` reports "invalid config: config key ...: ..." and unit
tests call them directly, in milliseconds, without Snakemake. Torch-free.
"""

from __future__ import annotations

import glob
import os
import string
from collections.abc import Mapping
from typing import Any

from snakellm.config import jobs
from snakellm.config.resolve import check_parallel_conflict, check_tokenizers, resolve_runs
from snakellm.errors import ConfigError
from snakellm.models import moe

# what NeMo packs as tokenizer artifacts
NEMO_TOKENIZER_KINDS = ("gpt2-bpe", "sentencepiece")


def _names(d: dict[str, Any]) -> str:
    return ", ".join(d) or "none"


def check_finetunes(config: dict[str, Any], run_models: dict[str, dict[str, Any]] | None = None) -> None:
    """A fine-tune names a known base (run or import) and data set, a batch its micro batch divides, and
    parallelism its method can use (snakellm.models.parallel_conflict) and, for a base run of ``run_models``
    (the runs' architectures), its model (a mixture of experts trains at tp > 1 only with sequence parallelism,
    which fine-tuning does not run)."""
    runs, imports, sft = config.get("runs", {}), config.get("import_hf", {}), config.get("sft_data", {})
    bases = list(runs) + list(imports)
    for name, ft in config.get("finetune", {}).items():
        if name == "base":  # runs/{run}/eval/base/ holds the base model's shared evaluations
            raise ConfigError("config key finetune.base: the name 'base' is reserved (runs/RUN/eval/base/)")
        if ft["run"] not in bases:
            raise ConfigError(
                f"config key finetune.{name}.run: unknown run {ft['run']!r} "
                f"(runs and import_hf: {', '.join(bases) or 'none'})"
            )
        if ft["data"] not in sft:
            raise ConfigError(
                f"config key finetune.{name}.data: unknown sft_data {ft['data']!r} (sft_data: {_names(sft)})"
            )
        preference = config["sft_data"][ft["data"]].get("format") == "preference"
        if preference != (ft["method"] == "dpo"):
            raise ConfigError(
                f"config key finetune.{name}.method: {ft['method']} on sft_data {ft['data']} of format "
                f"{config['sft_data'][ft['data']].get('format', 'squad')} (method dpo reads, and only it, "
                "format preference)"
            )
        check_start(name, ft, config)
        if preference:
            check_dpo(name, ft, config)
        else:
            check_example_template(name, ft, config["sft_data"][ft["data"]])
        t = ft["train"]
        if t["global_batch_size"] % t["micro_batch_size"]:
            raise ConfigError(
                f"config key finetune.{name}.train: global_batch_size {t['global_batch_size']} is not "
                f"a multiple of micro_batch_size {t['micro_batch_size']}"
            )
        kind = ft.get("dpo", {}).get("policy", "lora") if ft["method"] == "dpo" else ft["method"]
        check_parallel_conflict(f"finetune.{name}", {**ft.get("parallel", {}), "method": kind})
        arch = (run_models or {}).get(ft["run"])
        tp = ft.get("parallel", {}).get("tp", 1)
        why = moe.check_tp(arch, tp, None, lambda k: f"parallel.{k}") if arch else None
        if why:
            raise ConfigError(f"config key finetune.{name}.parallel.tp: base run {ft['run']}: {why}")


def _trains_whole(ft: dict[str, Any]) -> bool:
    """Whether a fine-tune's result is a whole model (model/): method full, or dpo with policy full."""
    return ft["method"] == "full" or (ft["method"] == "dpo" and (ft.get("dpo") or {}).get("policy") == "full")


def check_start(name: str, ft: dict[str, Any], config: dict[str, Any]) -> None:
    """``start``: a DPO fine-tune starts from a full fine-tune's model of the same run (SFT then DPO)."""
    start = ft.get("start")
    if start is None:
        return
    fts = config.get("finetune") or {}
    key = f"config key finetune.{name}.start"
    if ft["method"] != "dpo":
        raise ConfigError(
            f"{key}: {start!r}: only method dpo starts from another fine-tune's model (method {ft['method']} "
            "starts from its run; its base evaluation is the run's)"
        )
    if start not in fts or start == name:
        raise ConfigError(f"{key}: {start!r} is not another fine-tune (finetune: {_names(fts)})")
    if not _trains_whole(fts[start]):
        raise ConfigError(
            f"{key}: {start!r} is a {fts[start]['method']} fine-tune with no model of its own (LoRA adapters or "
            "a prompt table on its run): start needs a full fine-tune (method full, or dpo with policy full)"
        )
    if fts[start]["run"] != ft["run"]:
        raise ConfigError(f"{key}: {start!r} is a fine-tune of run {fts[start]['run']}, this one's is {ft['run']}")
    seen = [name, start]
    while fts[seen[-1]].get("start") is not None:  # a chain of starts must end at a run
        nxt = fts[seen[-1]]["start"]
        if nxt in seen:
            raise ConfigError(f"{key}: the starts go round in a circle ({' -> '.join([*seen, nxt])})")
        if nxt not in fts:
            break  # that fine-tune's own check names it
        seen.append(nxt)


def dpo_conflict(loss: str, beta: float, label_smoothing: float, reference: str, policy: str) -> str | None:
    """Why these dpo settings cannot be honoured (the setting named), or None."""
    if beta <= 0:
        return f"dpo.beta {beta}: must be positive"
    if label_smoothing and loss not in ("robust", "simpo"):
        return (
            f"dpo.label_smoothing {label_smoothing}: TRL's DPOTrainer uses it only with loss robust (and CPO's with "
            f"simpo), not {loss}"
        )
    if loss == "robust" and not 0 <= label_smoothing < 0.5:
        return f"dpo.label_smoothing {label_smoothing}: robust needs it in [0, 0.5)"
    if reference == "adapter-off" and policy != "lora":
        return "dpo.reference adapter-off: needs dpo.policy lora (a full policy has no adapters to turn off)"
    return None


def check_dpo(name: str, ft: dict[str, Any], config: dict[str, Any]) -> None:
    """The dpo block's settings against each other and the config (snakellm.finetune.preference's rules)."""
    d = ft.get("dpo", {})
    why = dpo_conflict(d["loss"], d["beta"], d["label_smoothing"], d["reference"], d["policy"])
    if why:
        raise ConfigError(f"config key finetune.{name}.{why}")
    ref = d["reference"]
    fts = config.get("finetune") or {}
    known = (
        ref in ("base", "adapter-off") or ref in (config.get("runs") or {}) or ref in (config.get("import_hf") or {})
    )
    if not known and not (ref in fts and fts[ref]["method"] in ("full", "lora")):
        raise ConfigError(
            f"config key finetune.{name}.dpo.reference: {ref!r} is not base, adapter-off, a key of runs or "
            "import_hf, or a full or LoRA fine-tune's name"
        )


# the string fields of prepare-sft's records, by source format: what a fine-tune's template may name
RECORD_FIELDS = {"squad": ("input", "output", "context", "question", "title"), "jsonl": ("input", "output")}
SQUAD_PROMPT_FIELDS = ("context", "question", "title")
CHAT_FORMATS = ("messages", "sharegpt")
CHAT_BUILTINS = ("chatml", "llama3", "mistral")  # snakellm.finetune.chat_template.BUILTIN (torch-free here)


def template_fields(template: str, key: str) -> list[str]:
    """The ``{name}`` fields of a template (str.format syntax), or an error naming the config key."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ConfigError(f"config key {key}: template {template!r}: {e}") from None
    fields = [f for _, f, spec, conv in parsed if f is not None]
    bad = [f for f in fields if not f.isidentifier()]
    if bad:
        raise ConfigError(f"config key {key}: template {template!r}: {{{bad[0]}}} is not a field name")
    return fields


def _instances(node: Any, parts: list[str], key: str = "") -> Any:
    """(dotted key, section dict) for every place of ``config`` matching a SECTIONS pattern (``*``: any name)."""
    if not parts:
        if isinstance(node, Mapping):
            yield key, node
        return
    if not isinstance(node, Mapping):
        return
    head, rest = parts[0], parts[1:]
    for name in node if head == "*" else [head] if head in node else []:
        yield from _instances(node[name], rest, f"{key}.{name}" if key else str(name))


_PATH_KINDS = {"file": ("file", os.path.isfile), "dir": ("directory", os.path.isdir)}


def check_paths(config: dict[str, Any]) -> None:
    """Every input a config names exists: the keys whose settings field says ``path=`` (snakellm.config.settings).

    Snakemake treats an input no rule makes and no file is as a reason to drop the jobs that need it when their
    outputs exist (a misspelt vocab_file once planned 28 jobs of 33, without a word), so a missing one is a
    config error naming its key. A new key gets this check by declaring ``path="file"`` (or ``"dir"``,
    ``"glob"``: at least one match) on its field. Relative paths are relative to the working directory.
    """
    from snakellm.config.sections import SECTIONS
    from snakellm.config.settings import path_fields

    for where, cls in SECTIONS.items():
        fields = path_fields(cls)
        if not fields:
            continue
        for key, section in _instances(config, where.split(".")):
            for name, (kind, unless, names) in fields.items():
                value = section.get(name)
                if value is None or (unless and section.get(unless)) or value in names:
                    continue
                for i, item in enumerate(value if isinstance(value, list) else [value]):
                    at = f"{key}.{name}" + (f"[{i}]" if isinstance(value, list) else "")
                    if not isinstance(item, str):
                        continue  # the schema reports the type
                    if kind == "glob":
                        if next(glob.iglob(item, recursive=True), None) is None:
                            raise ConfigError(f"config key {at}: no file matches {item!r} (relative to {os.getcwd()})")
                        continue
                    what, test = _PATH_KINDS[kind]
                    if not test(item):
                        why = f"not a {what}" if os.path.exists(item) else f"no such {what}"
                        raise ConfigError(f"config key {at}: {item}: {why} (relative to {os.getcwd()})")


def check_sft_data(config: dict[str, Any]) -> None:
    """A data set's template names its fields (its file: check_paths; a missing one once left the old splits)."""
    for name, d in config.get("sft_data", {}).items():
        if d.get("template") is None:
            continue
        fields = template_fields(d["template"], f"sft_data.{name}.template")
        unknown = [f for f in fields if f not in SQUAD_PROMPT_FIELDS]
        if d.get("format", "squad") == "squad" and unknown:
            raise ConfigError(
                f"config key sft_data.{name}.template: unknown field {{{unknown[0]}}} in {d['template']!r} "
                f"(a SQuAD question has {', '.join(SQUAD_PROMPT_FIELDS)})"
            )


def check_example_template(name: str, ft: dict[str, Any], data: dict[str, Any]) -> None:
    """The fine-tune's prompt template ends with its one {output} and names only fields its records have."""
    ex = ft.get("examples", {})
    if data.get("format", "squad") in CHAT_FORMATS:  # conversations: the chat template, not a prompt template
        chat = ex.get("chat_template")
        if chat and chat not in CHAT_BUILTINS and not os.path.isfile(chat):
            raise ConfigError(
                f"config key finetune.{name}.examples.chat_template: {chat!r} is neither a built-in "
                f"({', '.join(CHAT_BUILTINS)}) nor a file (relative to {os.getcwd()})"
            )
        return
    template, key = ex.get("template", "{input} {output}"), f"finetune.{name}.examples.template"
    fields = template_fields(template, key)
    if fields.count("output") != 1 or not template.rstrip().endswith("{output}"):
        raise ConfigError(f"config key {key}: {template!r} must end with {{output}} (the answer), once")
    known = RECORD_FIELDS[data.get("format", "squad")]
    unknown = [f for f in fields if f not in known]
    if unknown:
        raise ConfigError(
            f"config key {key}: unknown field {{{unknown[0]}}} in {template!r} (the records of sft_data "
            f"{ft['data']} have {', '.join(known)})"
        )
    cut = [f.strip() for f in ex.get("truncation_field", "input").split(",")]
    wrong = [f for f in cut if f not in fields or f == "output"]
    if wrong:
        raise ConfigError(
            f"config key finetune.{name}.examples.truncation_field: {wrong[0]!r} is not a prompt field of the "
            f"template {template!r} (one of: {', '.join(f for f in fields if f != 'output') or 'none'})"
        )


def check_resources(config: dict[str, Any], env: Mapping[str, str] | None = None) -> None:
    """Every GPU stage's allocation fits its parallelism (tp x pp divides the ranks, the global batch splits
    over the data-parallel ranks) before anything is submitted; ``env``: the site defaults (Slurm only)."""
    for name, run in config.get("runs", {}).items():
        par, t = run.get("parallel", {}), run["train"]
        jobs.check_allocation(
            jobs.allocation(config, "pretrain", name, env),
            par.get("tp", 1),
            par.get("pp", 1),
            (t["global_batch_size"], t["micro_batch_size"]),
            slurm=env is not None,
            virtual_pp=par.get("virtual_pp", 1),
        )
    for name, ft in config.get("finetune", {}).items():
        t = ft["train"]
        jobs.check_allocation(
            jobs.allocation(config, "finetune", name, env),
            ft.get("parallel", {}).get("tp", 1),
            1,
            (t.get("global_batch_size", 8), t.get("micro_batch_size", 4)),
            slurm=env is not None,
        )
    for stage, entries in jobs.STAGES.items():
        if entries is None:
            jobs.check_allocation(jobs.allocation(config, stage, None, env), slurm=env is not None)


def check_export_nemo(config: dict[str, Any], run_models: dict[str, dict[str, Any]] | None = None) -> None:
    """A .nemo packs only gpt2-bpe or sentencepiece tokenizers, and only models NeMo 1.x represents (not Qwen3's
    QK-norm, not mixtures of experts): an export that cannot work fails before training."""
    if not config.get("export_nemo", {}).get("enabled", True):
        return
    from snakellm.models import families

    tokenizers = config.get("tokenizers", {})
    for name, run in config.get("runs", {}).items():
        kind = tokenizers[run["tokenizer"]]["kind"]
        if kind not in NEMO_TOKENIZER_KINDS:
            raise ConfigError(
                f"config key runs.{name}.tokenizer: a .nemo packs only gpt2-bpe or sentencepiece "
                f"tokenizers, {run['tokenizer']!r} is {kind} (set export_nemo.enabled: false to skip the .nemo)"
            )
        arch = (run_models or {}).get(name)
        why = families.get(arch["style"]).nemo_refuses(arch) if arch else None
        if arch and why:
            raise ConfigError(
                f"config key runs.{name}.model: NeMo 1.x cannot represent this {arch['style']} model: {why} "
                "(set export_nemo.enabled: false to skip the .nemo)"
            )


def check_imports(config: dict[str, Any]) -> None:
    """An import is not named like a run, and its directory holds a Hugging Face config.json."""
    runs = config.get("runs", {})
    for name, spec in config.get("import_hf", {}).items():
        if name in runs:
            raise ConfigError(f"config key import_hf.{name}: a run of that name exists under runs")
        if spec.get("random"):
            if os.path.normpath(spec["hf_dir"]) != f"models/random/{name}":
                raise ConfigError(
                    f"config key import_hf.{name}.hf_dir: with `random` it is the directory the workflow writes, "
                    f"models/random/{name}; got {spec['hf_dir']!r}"
                )
            continue
        if not os.path.isfile(os.path.join(spec["hf_dir"], "config.json")):
            raise ConfigError(
                f"config key import_hf.{name}.hf_dir: {spec['hf_dir']!r} has no config.json "
                "(not a Hugging Face model directory)"
            )


def check_hf_exports(config: dict[str, Any], run_models: dict[str, dict[str, Any]]) -> None:
    """Every run's architecture has a Hugging Face class that computes exactly what it does."""
    if not config.get("export_hf", {}).get("enabled", True):
        return
    from snakellm.models import families

    for name, arch in run_models.items():
        try:
            families.for_arch(arch)
        except families.FamilyError as e:
            raise ConfigError(f"config key runs.{name}.model: Hugging Face export: {e}") from None


def import_tokenizer_kind(hf_dir: str) -> str:
    """What import-hf will make of an HF directory's tokenizer (snakellm/export/hf_tokenizer.py)."""

    def has(f: str) -> bool:
        return os.path.isfile(os.path.join(hf_dir, f))

    if has("vocab.json") and has("merges.txt"):
        return "gpt2-bpe"
    return "sentencepiece" if has("tokenizer.model") else "huggingface"


def curate_indexes(config: dict[str, Any]) -> dict[str, list[str]]:
    """Index name -> the sources it deduplicates together, in config order (sources with a ``curate`` section)."""
    out: dict[str, list[str]] = {}
    for name, spec in (config.get("sources") or {}).items():
        if spec.get("curate") is not None:
            out.setdefault(spec["curate"].get("index") or name, []).append(name)
    return out


def check_sources(config: dict[str, Any]) -> None:
    """A source slices into chunks one way (``shards_per_chunk`` or, local parquet only, ``row_groups_per_chunk``);
    ``id_key`` and ``columns`` are settings of the columnar formats only."""
    from snakellm.config.sections import COLUMNAR_FORMATS

    for name, spec in (config.get("sources") or {}).items():
        where = f"config key sources.{name}"
        per_shard, per_rg = spec.get("shards_per_chunk"), spec.get("row_groups_per_chunk")
        if (per_shard is None) == (per_rg is None):
            raise ConfigError(
                f"{where}: set exactly one of shards_per_chunk (whole shards per chunk) and row_groups_per_chunk "
                "(local parquet: row groups of one file per chunk)"
            )
        if per_rg is not None and (spec.get("format") != "parquet" or spec.get("kind") != "local"):
            raise ConfigError(
                f"{where}.row_groups_per_chunk: only local parquet files are sliced by row group (their footers are "
                f"read at planning time); this source is {spec.get('kind')} {spec.get('format')}: use shards_per_chunk"
            )
        if spec.get("format") not in COLUMNAR_FORMATS:
            for k in ("columns",):
                if spec.get(k) is not None:
                    raise ConfigError(f"{where}.{k}: only parquet and arrow sources have columns to keep")
            if spec.get("id_key", "id") != "id":
                raise ConfigError(f"{where}.id_key: only parquet and arrow sources have an id column")


def check_curate(config: dict[str, Any]) -> None:
    """Sources sharing a duplicate index hash alike (the same exact and near settings), and an index named after
    a source is that source's own."""
    sources = config.get("sources") or {}
    for index, members in curate_indexes(config).items():
        if index in sources and index not in members:
            raise ConfigError(
                f"config key sources.{members[0]}.curate.index: {index!r} is the name of another source, whose "
                "own index it would be; choose another name"
            )
        first = sources[members[0]]["curate"]
        for other in members[1:]:
            cur = sources[other]["curate"]
            for key in ("exact", "near"):
                if cur.get(key) != first.get(key):
                    raise ConfigError(
                        f"config key sources.{other}.curate.{key}: sources sharing the index {index!r} must hash "
                        f"alike, and sources.{members[0]}.curate.{key} is {first.get(key)!r}"
                    )


def check_fp8(config: dict[str, Any], run_models: dict[str, dict[str, Any]]) -> None:
    """A run with ``precision: fp8`` has block weights float8 kernels take (each TP shard a multiple of 16);
    ``parallel.fp8_all_gather`` has fp8's tensorwise recipe."""
    from snakellm.models import fp8

    for name, run in config.get("runs", {}).items():
        if run["train"].get("precision") == "fp8":
            try:
                fp8.check_shapes(run_models[name], run.get("parallel", {}).get("tp", 1))
            except fp8.FP8Error as e:
                raise ConfigError(f"config key runs.{name}.train.precision: {e}") from None
        t = run["train"]
        why = fp8.all_gather_conflict(
            bool(run.get("parallel", {}).get("fp8_all_gather")),
            t.get("precision", "auto"),
            t.get("fp8_recipe", "tensorwise"),
        )
        if why:
            raise ConfigError(f"config key runs.{name}.parallel.fp8_all_gather: the float8 all-gather {why}")


def check_grad_reduce(config: dict[str, Any]) -> None:
    """A run or fine-tune with ``parallel.grad_reduce_dtype: bf16`` trains bf16 weights (precision bf16 or fp8)."""
    from snakellm.models import grad_reduce_conflict

    for section in ("runs", "finetune"):
        for name, job in config.get(section, {}).items():
            dtype = job.get("parallel", {}).get("grad_reduce_dtype", "fp32")
            why = grad_reduce_conflict(dtype, job.get("train", {}).get("precision", "auto"))
            if why:
                raise ConfigError(f"config key {section}.{name}.parallel.grad_reduce_dtype: {dtype} {why}")


def llama_cpp_warnings(config: dict[str, Any], run_models: dict[str, dict[str, Any]]) -> list[str]:
    """Runs whose Hugging Face export llama.cpp's ``convert_hf_to_gguf.py`` refuses (a warning, not an error).

    llama.cpp pairs a GPT-2 model with byte-level BPE only: a gpt2-style run with a SentencePiece tokenizer
    (the embedded default's tiny run) stops there with "BPE pre-tokenizer was not recognized". Its Llama and
    GPT-2 + GPT-2 BPE exports convert and run token for token as transformers does (docs/export-and-serving.md).
    """
    if not config.get("export_hf", {}).get("enabled", True):
        return []
    tokenizers = config.get("tokenizers", {})
    out = []
    for name, arch in run_models.items():
        tok = config["runs"][name]["tokenizer"]
        kind = tokenizers.get(tok, {}).get("kind")
        if arch.get("style") == "gpt2" and kind == "sentencepiece":
            out.append(
                f"runs.{name}: llama.cpp's convert_hf_to_gguf.py will not convert runs/{name}/hf (a GPT-2 model "
                f"with the SentencePiece tokenizer {tok!r}: llama.cpp pairs GPT-2 with byte-level BPE only); "
                "a llama-style model, or a gpt2-bpe tokenizer, converts"
            )
    return out


def check_config(config: dict[str, Any], env: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Every cross-field check, in the order a reader meets the sections; returns each run's architecture.

    ``env``: the environment whose site defaults the job allocations take (under the Slurm profile).
    """
    check_paths(config)
    check_sources(config)
    check_curate(config)
    check_tokenizers(config)
    run_models = resolve_runs(config)
    check_sft_data(config)
    check_finetunes(config, run_models)
    check_resources(config, env)
    check_fp8(config, run_models)
    check_grad_reduce(config)
    check_export_nemo(config, run_models)
    check_imports(config)
    check_hf_exports(config, run_models)
    return run_models
