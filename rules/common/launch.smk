# Job resources and launch prefixes of every stage (included by the Snakefile after rules/common.smk,
# whose ON_SLURM and SITE_ENV they read): one function per stage kind, so a new GPU rule needs one line.


# ---------------------------------------------------------------- launch (snakellm/launch/prefix.py)


def _allocation(stage, wildcards):
    """The job's allocation (snakellm.config.jobs): its run's or fine-tune's own, else the stage's."""
    entry = jobmod.STAGES[stage]
    name = wildcards[entry[1]] if entry else None
    return jobmod.allocation(config, stage, name, SITE_ENV)


def get_job_resources(stage):
    """The resources of a `stage` job (pretrain, finetune, evaluate, generate, convert), from config:
    `resources: **get_job_resources("evaluate")` in a rule is all a new GPU rule needs. Keys no entry
    of the stage sets are left out, so the profile's default-resources fill them."""
    entry = jobmod.STAGES[stage]
    names = list(config.get(entry[0], {})) if entry else [None]
    keys = {
        k
        for n in names
        for k in jobmod.snakemake_resources(
            jobmod.allocation(config, stage, n, SITE_ENV), 1
        )
    }
    if not ON_SLURM:
        keys.discard("mpi")  # the local executor: torchrun starts the ranks

    def one(key):
        return lambda wildcards, threads: jobmod.snakemake_resources(
            _allocation(stage, wildcards), threads
        ).get(key)

    return {k: one(k) for k in sorted(keys)}


def get_launch_prefix(stage):
    """A params function: `srun ...` (Slurm profile, a multi-rank job), `torchrun ...` (ranks > 1
    elsewhere) or "" in front of the step's command, plus the job's container. Taking `resources`
    keeps it out of Snakemake's params rerun trigger: changing profile or node count reruns nothing.
    """
    from snakellm.launch.prefix import launch_prefix

    def launch(wildcards, resources):
        return launch_prefix(resources, _allocation(stage, wildcards).container)

    return launch
