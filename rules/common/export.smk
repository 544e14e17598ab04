# Lookups and targets of export, import and generation (rules/export.smk, rules/evaluate.smk);
# included by the Snakefile after rules/common.smk.


# ---------------------------------------------------------------- export, import, generation (rules/export.smk, evaluate.smk)

EXPORT_NEMO = config["export_nemo"]
# {name: {hf_dir, make_vocab_size_divisible_by, random}}
IMPORTS = config.get("import_hf", {})
# imports whose hf_dir the workflow writes (models/random/{name}, random weights, by the random_hf rule)
RANDOM_IMPORTS = [name for name, spec in IMPORTS.items() if spec.get("random")]


def _import_files():
    """The files of each HF directory, listed once at parse time: an edited weight file reruns the import.
    A random import's input is the directory that rule random_hf writes."""
    return {
        name: (
            [spec["hf_dir"]]
            if spec.get("random")
            else sorted(
                os.path.join(spec["hf_dir"], f)
                for f in os.listdir(spec["hf_dir"])
                if os.path.isfile(os.path.join(spec["hf_dir"], f))
            )
        )
        for name, spec in IMPORTS.items()
    }


IMPORT_FILES = _import_files()


wildcard_constraints:
    run=_names_regex(list(RUNS) + list(IMPORTS)),


def get_import_hf_files(wildcards):
    return IMPORT_FILES[wildcards.run]


def get_import_hf_dir(wildcards):
    return IMPORTS[wildcards.run]["hf_dir"]


def get_import_hf_flags(wildcards):
    return flags(S.ImportHfSettings, IMPORTS[wildcards.run])


def get_random_hf_flags(wildcards):
    return flags(S.RandomHfSettings, IMPORTS[wildcards.name]["random"])


def get_run_done(wildcards):
    """The file that says a run's checkpoint is final: train_summary.json, or an import's import_summary.json."""
    if wildcards.run in IMPORTS:
        return f"runs/{wildcards.run}/import_summary.json"
    return f"runs/{wildcards.run}/train_summary.json"


def get_export_nemo_targets():
    return [f"runs/{run}/{run}.nemo" for run in RUNS] if EXPORT_NEMO["enabled"] else []


_NOTED = set()


def _note_once(message):
    """A line on stderr for the user, once per Snakemake start (not from a job-side Snakemake)."""
    if workflow.is_main_process and message not in _NOTED:
        _NOTED.add(message)
        print(message, file=sys.stderr)


def get_import_nemo_targets(names):
    """The .nemo of these imports, when enabled and NeMo can pack their tokenizer (not a tokenizer.json)."""
    if not EXPORT_NEMO["enabled"]:
        return []
    out = []
    for n in names:
        if (
            IMPORTS[n].get("random")  # GPT-2's BPE files
            or checkmod.import_tokenizer_kind(IMPORTS[n]["hf_dir"])
            in checkmod.NEMO_TOKENIZER_KINDS
        ):
            out.append(f"runs/{n}/{n}.nemo")
        else:
            _note_once(
                f"import_hf.{n}: no .nemo: its tokenizer is a Hugging Face tokenizer.json, which NeMo 1.x "
                "cannot pack (export_nemo.enabled: false silences this)"
            )
    return out


def get_hf_targets():
    """HF directories and samples of every run and import; imports' .nemo when NeMo can pack their tokenizer."""
    names = list(RUNS) + list(IMPORTS)
    out = [f"runs/{n}/import_summary.json" for n in IMPORTS]
    out += get_import_nemo_targets(IMPORTS)
    if config["export_hf"]["enabled"]:
        out += [f"runs/{n}/hf" for n in names]
    if config["generate"]["enabled"]:
        out += [f"runs/{n}/samples.jsonl" for n in names]
    return out
