# Lookups of the fine-tuning rules (rules/finetune.smk, rules/evaluate.smk).

SFT_DATA = config.get("sft_data", {})  # {task: {path, format, template, ...}}
FINETUNES = config.get("finetune", {})  # {name: {run, data, method, lora, ...}}
# the base model's evaluations, each shared by the fine-tunes of one run, data set and evaluation settings:
# {(run, task, key): a fine-tune that uses it} (snakellm.config.flags.base_eval_key)
BASE_EVALS = {
    (ft["run"], ft["data"], flagmod.base_eval_key(ft)): name
    for name, ft in FINETUNES.items()
}


wildcard_constraints:
    task=_names_regex(SFT_DATA),
    ft=_names_regex(FINETUNES),
    key="[0-9a-f]{8}",


def _template_input(ft):
    """A fine-tune's chat template file, as an input of every job that renders with it (editing the file
    reruns them; a built-in name is in the jobs' flags instead)."""
    t = (ft.get("examples") or {}).get("chat_template")
    return {"chat_template": t} if t and t not in S.CHAT_TEMPLATE_NAMES else {}


def get_sft_source(wildcards):
    return SFT_DATA[wildcards.task]["path"]


def get_sft_flags(wildcards):
    """`snakellm prepare-sft` settings of one data set: editing another reruns nothing."""
    return flags(S.SftDataSettings, SFT_DATA[wildcards.task])


def _ft(wildcards):
    ft = FINETUNES[wildcards.ft]
    if ft["run"] != wildcards.run:
        raise WorkflowError(
            f"finetune {wildcards.ft} is based on run {ft['run']}, not {wildcards.run}"
        )
    return ft


def _base_inputs(ft):
    """The base model's final file (the run carries its tokenizer: runs/RUN/tokenizer/)."""
    if ft["run"] in RUNS:
        return {"base": f"runs/{ft['run']}/train_summary.json"}
    return {"base": f"runs/{ft['run']}/import_summary.json"}


def _start_model(ft):
    """(the model a fine-tune starts from, its final file): its run's, or its `start` fine-tune's model/ (SFT
    then DPO), whose finetune_summary.json is written last: a retrained start reruns this fine-tune.
    """
    if ft.get("start"):
        d = f"runs/{ft['run']}/finetune/{ft['start']}"
        return f"{d}/model", f"{d}/finetune_summary.json"
    return f"runs/{ft['run']}", _base_inputs(ft)["base"]


def get_finetune_base(wildcards):
    """`snakellm finetune --base`: the run, or the start fine-tune's model/."""
    return _start_model(_ft(wildcards))[0]


def get_finetune_input(wildcards):
    ft = _ft(wildcards)
    d = f"data/sft/{ft['data']}"
    ref = (
        {
            "reference": f"runs/{ft['run']}/finetune/{wildcards.ft}/reference_logprobs.json"
        }
        if _needs_reference(ft)
        else {}
    )
    return (
        {"base": _start_model(ft)[1]}
        | {
            "train": f"{d}/train.jsonl",
            "validation": f"{d}/validation.jsonl",
        }
        | ref
        | _template_input(ft)
    )


def _needs_reference(ft):
    """A DPO fine-tune reads its reference's log-probabilities from a file (not adapter-off, not simpo)."""
    dpo = ft.get("dpo") or {}
    return (
        ft["method"] == "dpo"
        and dpo.get("reference") != "adapter-off"
        and dpo.get("loss") != "simpo"
    )


def _reference_model(ft):
    """(the reference's directory, its final file, its adapter or None): the fine-tune's starting model (its
    run or its start's model: TRL's default, the initial policy), another run, a full fine-tune's model, or
    a LoRA fine-tune's base run plus its adapter."""
    ref = ft["dpo"]["reference"]
    if ref == "base":
        return (*_start_model(ft), None)
    if ref in RUNS or ref in IMPORTS:
        return f"runs/{ref}", _base_inputs({"run": ref})["base"], None
    if ref in FINETUNES and FINETUNES[ref]["method"] in ("full", "lora"):
        run = FINETUNES[ref]["run"]
        d = f"runs/{run}/finetune/{ref}"
        if FINETUNES[ref]["method"] == "lora":
            return f"runs/{run}", f"{d}/finetune_summary.json", f"{d}/adapter"
        return f"{d}/model", f"{d}/finetune_summary.json", None
    raise WorkflowError(
        f"dpo.reference {ref!r}: base, adapter-off, a key of runs or import_hf, or a full or LoRA fine-tune's name"
    )


def get_reference_input(wildcards):
    ft = _ft(wildcards)
    d = f"data/sft/{ft['data']}"
    return (
        {"model": _reference_model(ft)[1]}
        | {s: f"{d}/{s}.jsonl" for s in ("train", "validation", "test")}
        | _template_input(ft)
    )


def get_reference_flags(wildcards):
    """Only what decides the reference's numbers: its model, the pairs' tokenization and the precision
    (beta, the loss, the learning rate and the steps are not here: changing them reuses the file).
    """
    ft = _ft(wildcards)
    model, _, adapter = _reference_model(ft)
    return flagmod.reference_flags(ft, model, adapter)


def get_finetune_flags(wildcards):
    """Every `snakellm finetune` setting (snakellm.config.flags.finetune_flags): reruns when one changes."""
    ft = _ft(wildcards)
    return flagmod.join(
        flagmod.finetune_flags(ft),
        flagmod.tracking_flags(config.get("tracking"), ft.get("tracking")),
    )


def get_finetune_threads(wildcards):
    return FINETUNES[wildcards.ft]["parallel"]["threads"]


def _trains(ft):
    """What a fine-tune's weights are: lora | full | ptuning (a DPO fine-tune: its policy's)."""
    return ft["dpo"]["policy"] if ft["method"] == "dpo" else ft["method"]


def get_export_peft_input(wildcards):
    ft = _ft(wildcards)
    if _trains(ft) == "full":
        raise WorkflowError(
            f"finetune {wildcards.ft} is a full fine-tune: its exports are hf/ and {wildcards.ft}.nemo"
        )
    # base_model_name_or_path: an imported base's own Hugging Face directory, else the run's export (the
    # start fine-tune's hf/ where the adapters are on its model)
    base = (
        f"runs/{ft['run']}/finetune/{ft['start']}/hf"
        if ft.get("start")
        else (
            IMPORTS[ft["run"]]["hf_dir"]
            if ft["run"] in IMPORTS
            else f"runs/{ft['run']}/hf"
        )
    )
    return {
        "summary": f"runs/{ft['run']}/finetune/{wildcards.ft}/finetune_summary.json",
        "base": base,
    }


def get_export_peft_source(wildcards):
    d = f"runs/{wildcards.run}/finetune/{wildcards.ft}"
    if _trains(FINETUNES[wildcards.ft]) == "lora":
        return f"--adapter {d}/adapter"
    return f"--prompt {d}/prompt"


def get_merge_base_input(wildcards):
    """merge_lora_hf's base: the run's final file, or the start fine-tune's (its model/ is the base)."""
    return _start_model(_ft(wildcards))[1]


def get_full_finetune_summary(wildcards):
    ft = _ft(wildcards)
    if _trains(ft) != "full":
        raise WorkflowError(
            f"finetune {wildcards.ft} ({ft['method']}) has no model of its own: see its hf_peft/ export"
        )
    return f"runs/{ft['run']}/finetune/{wildcards.ft}/finetune_summary.json"


def base_eval_dir(name):
    """Where the base model's evaluation for fine-tune `name` lies (shared, see BASE_EVALS)."""
    ft = FINETUNES[name]
    return f"runs/{ft['run']}/eval/base/{ft['data']}/{flagmod.base_eval_key(ft)}"


def _base_eval_ft(wildcards):
    key = (wildcards.run, wildcards.task, wildcards.key)
    if key not in BASE_EVALS:
        raise WorkflowError(
            f"no fine-tune of run {wildcards.run} on {wildcards.task} evaluates with settings {wildcards.key}"
        )
    return FINETUNES[BASE_EVALS[key]]


def get_base_eval_input(wildcards):
    ft = _base_eval_ft(wildcards)
    return (
        _base_inputs(ft)
        | {"test": f"data/sft/{ft['data']}/test.jsonl"}
        | _template_input(ft)
    )


def get_base_eval_flags(wildcards):
    return flagmod.evaluate_flags(_base_eval_ft(wildcards))


def get_base_eval_threads(wildcards):
    return _base_eval_ft(wildcards)["parallel"]["threads"]


def get_evaluate_input(wildcards):
    ft = _ft(wildcards)
    return (
        _base_inputs(ft)
        | {
            "test": f"data/sft/{ft['data']}/test.jsonl",
            "finetune": f"runs/{ft['run']}/finetune/{wildcards.ft}/finetune_summary.json",
        }
        | _template_input(ft)
    )


def get_evaluate_model(wildcards):
    """The evaluated model: the base run + its adapter / prompt table, or the full fine-tune's model."""
    ft = _ft(wildcards)
    d = f"runs/{ft['run']}/finetune/{wildcards.ft}"
    return {
        "lora": f"--base runs/{ft['run']} --adapter {d}/adapter",
        "ptuning": f"--base runs/{ft['run']} --prompt {d}/prompt",
    }.get(ft["method"], f"--base {d}/model")


def get_evaluate_flags(wildcards):
    return flagmod.evaluate_flags(_ft(wildcards))


def get_compare_input(wildcards):
    ft = _ft(wildcards)
    if (
        ft["method"] == "dpo"
    ):  # evaluated in the fine-tune itself: held-out pairs before and after
        return {
            "summary": f"runs/{wildcards.run}/finetune/{wildcards.ft}/finetune_summary.json"
        }
    base = base_eval_dir(wildcards.ft)
    tuned = f"runs/{wildcards.run}/eval/{wildcards.ft}/tuned"
    return {"base": f"{base}/metrics.json", "tuned": f"{tuned}/metrics.json"}


def get_compare_sides(wildcards, input):
    """`snakellm compare-eval`'s two sides: two evaluation directories, or a DPO fine-tune's summary."""
    if "summary" in input.keys():
        return f"--preference {input.summary}"
    return (
        f"--base {os.path.dirname(input.base)} --tuned {os.path.dirname(input.tuned)}"
    )


EVAL_FILES = (
    "metrics.json",
    "predictions.jsonl",
    "predictions_test_dataloader0_inputs_preds_labels.jsonl",
)


def _has_test_pairs(ft):
    """Whether the fine-tune's data set has a test split (its share in sft_data.NAME.split is not 0)."""
    split = str(SFT_DATA[ft["data"]].get("split", "80,10,10")).split(",")
    return len(split) < 3 or float(split[2]) > 0


def get_finetune_targets():
    out = []
    for name, ft in FINETUNES.items():
        d = f"runs/{ft['run']}"
        out += [f"{d}/finetune/{name}/finetune_summary.json"]
        if (
            ft["method"] == "dpo"
        ):  # evaluated in the fine-tune itself: held-out pairs, compared before and after
            if _has_test_pairs(ft):
                out += [
                    f"{d}/eval/{name}/comparison.{x}" for x in ("json", "tsv", "md")
                ]
            if _trains(ft) == "lora":
                out.append(f"{d}/finetune/{name}/hf_peft/adapter_config.json")
                if config["export_hf"]["enabled"]:
                    out.append(f"{d}/finetune/{name}/hf_merged")
            else:
                out += [f"{d}/finetune/{name}/hf", f"{d}/finetune/{name}/{name}.nemo"]
            continue
        out += [f"{d}/eval/{name}/tuned/{f}" for f in EVAL_FILES]
        out += [f"{base_eval_dir(name)}/{f}" for f in EVAL_FILES]
        out += [f"{d}/eval/{name}/comparison.{x}" for x in ("json", "tsv", "md")]
        if ft["method"] == "full":
            out += [f"{d}/finetune/{name}/hf", f"{d}/finetune/{name}/{name}.nemo"]
        else:
            out.append(f"{d}/finetune/{name}/hf_peft/adapter_config.json")
            if ft["method"] == "lora" and config["export_hf"]["enabled"]:
                out.append(f"{d}/finetune/{name}/hf_merged")
    return out


def get_finetune_chain_targets():
    """The fine-tunes' targets and the .nemo of each imported base (NeMo Launcher's chain: HF -> .nemo -> PEFT)."""
    bases = sorted({ft["run"] for ft in FINETUNES.values() if ft["run"] in IMPORTS})
    return get_finetune_targets() + get_import_nemo_targets(bases)
