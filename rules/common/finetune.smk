# Lookups of the fine-tuning rules (rules/finetune.smk, rules/evaluate.smk).

SFT_DATA = config.get("sft_data", {})  # {task: {path, format, template, ...}}
FINETUNES = config.get("finetune", {})  # {name: {run, data, method, lora, ...}}


wildcard_constraints:
    task=_names_regex(SFT_DATA),
    ft=_names_regex(FINETUNES),
    which="base|tuned",


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


def get_finetune_input(wildcards):
    ft = _ft(wildcards)
    d = f"data/sft/{ft['data']}"
    return _base_inputs(ft) | {
        "train": f"{d}/train.jsonl",
        "validation": f"{d}/validation.jsonl",
    }


def get_finetune_flags(wildcards):
    """Every `snakellm finetune` setting (snakellm.config.flags.finetune_flags): reruns when one changes."""
    return flagmod.finetune_flags(_ft(wildcards))


def get_finetune_threads(wildcards):
    return FINETUNES[wildcards.ft]["parallel"]["threads"]


def get_evaluate_input(wildcards):
    ft = _ft(wildcards)
    inp = _base_inputs(ft) | {"test": f"data/sft/{ft['data']}/test.jsonl"}
    if wildcards.which == "tuned":
        inp["finetune"] = (
            f"runs/{ft['run']}/finetune/{wildcards.ft}/finetune_summary.json"
        )
    return inp


def get_evaluate_model(wildcards):
    """The evaluated model: the base run, + its adapter / prompt table, or the full fine-tune's model."""
    ft = _ft(wildcards)
    d = f"runs/{ft['run']}/finetune/{wildcards.ft}"
    if wildcards.which == "base":
        return f"--base runs/{ft['run']}"
    return {
        "lora": f"--base runs/{ft['run']} --adapter {d}/adapter",
        "ptuning": f"--base runs/{ft['run']} --prompt {d}/prompt",
    }.get(ft["method"], f"--base {d}/model")


def get_evaluate_flags(wildcards):
    return flagmod.evaluate_flags(_ft(wildcards))


def get_finetune_targets():
    out = []
    for name, ft in FINETUNES.items():
        d = f"runs/{ft['run']}"
        out += [f"{d}/finetune/{name}/finetune_summary.json"]
        out += [
            f"{d}/eval/{name}/{w}/{f}"
            for w in ("base", "tuned")
            for f in ("metrics.json", "predictions.jsonl")
        ]
        if ft["method"] == "lora":
            out.append(f"{d}/finetune/{name}/hf_peft/adapter_config.json")
            if config["export_hf"]["enabled"]:
                out.append(f"{d}/finetune/{name}/hf_merged")
    return out


def get_finetune_chain_targets():
    """The fine-tunes' targets and the .nemo of each imported base (NeMo Launcher's chain: HF -> .nemo -> PEFT)."""
    bases = sorted({ft["run"] for ft in FINETUNES.values() if ft["run"] in IMPORTS})
    return get_finetune_targets() + get_import_nemo_targets(bases)
