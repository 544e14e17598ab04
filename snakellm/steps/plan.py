"""``snakellm plan``: show how the configured sources are sliced into chunks, and what each run needs.

The same planning code the Snakefile runs, without Snakemake: handy to check a
new source (how many shards a glob or URL template gives, which shards land in
which chunk) before launching anything. For each training run it also checks the
batch against the parallel layout of the job it would get (the run's allocation from
config, :mod:`snakellm.config.jobs`, with the Slurm profile's ``SNAKELLM_TRAIN_*`` site
defaults; or ``--nodes``/``--gpus-per-node``) exactly as ``snakellm train`` will, and prints
the memory per GPU (``snakellm.models.memory``): whether it fits is known before submitting.
For each fine-tune it prints the same for its job (LoRA and p-tuning hold no gradients or Adam
states for the frozen base) and the layout and micro batch that fit the GPUs
(``--gpu-memory-gib``): the smallest tensor-parallel size, then the largest micro batch.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

from snakellm.config import jobs
from snakellm.config import validate as cfgmod
from snakellm.config.settings import DefaultsHelpFormatter
from snakellm.data import planning as plan
from snakellm.io.log import plural

SCHEMA = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``snakellm plan``, apart from :func:`main` so that tests and ``--help`` checks build it alone."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm plan",
        description="Print the chunk plan of the configured sources (shards sorted naturally, "
        "sliced into runs of shards_per_chunk; one job per chunk).",
    )
    p.add_argument("--config", default="config/config.yaml", help="workflow config (default config/config.yaml)")
    p.add_argument("--schema", default=str(SCHEMA), help=argparse.SUPPRESS)
    p.add_argument("--source", action="append", help="only these sources")
    p.add_argument("--json", action="store_true", help="print {source: {chunk: [shards]}} as JSON")
    p.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="nodes of a training job (default: the run's allocation: runs.<name>.resources, resources.pretrain, "
        "$SNAKELLM_TRAIN_NODES, else 1)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="ranks (GPUs) per node (default: the run's allocation, $SNAKELLM_TRAIN_GPUS_PER_NODE, else 1)",
    )
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=80.0,
        help="memory of one GPU, for the fits/does-not-fit line (default: %(default)s)",
    )
    p.add_argument("--run", action="append", help="only these runs")
    p.add_argument("--finetune", action="append", help="only these fine-tunes")
    p.add_argument(
        "--docs-per-shard",
        type=float,
        default=10_000.0,
        help="documents per shard where no chunk stats exist yet, for the curation memory (SlimPajama: 590M "
        "documents in 59,166 shards, about 10,000)",
    )
    p.add_argument(
        "--dup-fraction",
        type=float,
        default=0.5,
        help="share of documents that are duplicates, for the clustering job's memory (RedPajama -> SlimPajama: 0.49)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        cfg = cfgmod.load(a.config, a.schema)
    except (cfgmod.ConfigError, OSError) as e:
        print(f"snakellm plan: {a.config}: {e}", file=sys.stderr)
        return 1
    plans = {name: plan.plan_source(spec) for name, spec in cfg["sources"].items() if not a.source or name in a.source}
    if a.json:
        json.dump(plans, sys.stdout, indent=1)
        print()
        return 0
    for name, chunks in plans.items():
        n = sum(map(len, chunks.values()))
        spec = cfg["sources"][name]
        if spec.get("row_groups_per_chunk"):
            files = len({plan.split_slice(s)[0] for c in chunks.values() for s in c})
            print(
                f"{name}: {plural(files, 'file')} -> {plural(len(chunks), 'chunk')} of <= "
                f"{spec['row_groups_per_chunk']} row groups"
            )
        else:
            print(f"{name}: {plural(n, 'shard')} -> {plural(len(chunks), 'chunk')} of <= {spec['shards_per_chunk']}")
        items = list(chunks.items())
        shown: list[tuple[str, list[str]] | None] = list(items) if len(items) <= 3 else [*items[:2], None, items[-1]]
        for item in shown:
            if item is None:
                print(f"  ... {len(items) - 3} more")
                continue
            c, shards = item
            print(f"  {c}: {plural(len(shards), 'shard')}, {plan.describe(shards[0])} .. {plan.describe(shards[-1])}")
    for line in curate_plan(cfg, plans, a.docs_per_shard, a.dup_fraction):
        print(line)
    status = 0
    for name, run in (cfg.get("runs") or {}).items():
        if a.run and name not in a.run:
            continue
        print()
        job = jobs.allocation(cfg, "pretrain", name, os.environ)
        nodes, per_node = a.nodes or job.nodes, a.gpus_per_node or job.gpus_per_node or 1
        try:
            lines = run_plan(name, run, cfg, nodes, per_node, a.gpu_memory_gib)
            if (nodes, per_node) == (job.nodes, job.gpus_per_node):
                lines.insert(1, f"  job ({job.where}): {job.describe()}")
            print("\n".join(_cpu_note(lines, job.gpus_per_node == 0 and not a.gpus_per_node)))
        except ValueError as e:
            print(f"run {name}: error: {e}")
            status = 2
    for name, ft in (cfg.get("finetune") or {}).items():
        if (a.finetune and name not in a.finetune) or (a.run and not a.finetune):
            continue
        print()
        job = jobs.allocation(cfg, "finetune", name, os.environ)
        nodes, per_node = a.nodes or job.nodes, a.gpus_per_node or job.gpus_per_node or 1
        try:
            lines = finetune_plan(name, ft, cfg, nodes * per_node, a.gpu_memory_gib)
            print("\n".join(_cpu_note(lines, job.gpus_per_node == 0 and not a.gpus_per_node)))
        except ValueError as e:
            print(f"finetune {name}: error: {e}")
            status = 2
    return status


def finetune_base(cfg: dict[str, Any], base: str) -> tuple[dict[str, Any], int | None]:
    """(architecture, tokenizer vocabulary or None) of a fine-tune's base: a run, an import, a random import."""

    from snakellm import models as arch_mod

    if base in (cfg.get("runs") or {}):
        run = cfg["runs"][base]
        model = dict(run.get("model") or {})
        tok = (cfg.get("tokenizers") or {}).get(run.get("tokenizer"), {})
        return arch_mod.resolve(model.pop("preset", None), model), tok.get("vocab_size")
    spec = (cfg.get("import_hf") or {})[base]
    if spec.get("random"):
        from snakellm.export.random_hf import GPT2_VOCAB

        arch = arch_mod.resolve(spec["random"]["preset"], {})
        return {**arch, "make_vocab_size_divisible_by": spec.get("make_vocab_size_divisible_by", 128)}, GPT2_VOCAB
    from snakellm.export.hf import arch_from_hf

    hf = json.loads((Path(spec["hf_dir"]) / "config.json").read_text())
    arch = arch_from_hf(hf, str(Path(spec["hf_dir"]) / "config.json"))
    return {**arch, "make_vocab_size_divisible_by": spec.get("make_vocab_size_divisible_by", 128)}, hf["vocab_size"]


def _has_gpu() -> bool:
    """Whether this machine shows an NVIDIA GPU (torch-free: the driver's device list)."""
    try:
        return bool(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return False


def _cpu_note(lines: list[str], cpu_job: bool) -> list[str]:
    """The fits-in-GPUs verdict says where it applies: a CPU job, or a GPU job planned on a machine without one
    (the default run trains on the CPU here: "fits in 80 GiB GPUs" alone read as if it needed one)."""
    if not cpu_job and _has_gpu():
        return lines
    where = (
        "a CPU job (gpus_per_node 0): the figures are host memory"
        if cpu_job
        else "this machine has no GPU: run here, the job trains on the CPU and the figures are host memory"
    )
    out = []
    for line in lines:
        out.append(line)
        if " GiB GPUs (with 10% + 2 GiB headroom)" in line:
            out.append(line[: len(line) - len(line.lstrip())] + f"({where})")
    return out


def finetune_plan(name: str, ft: dict[str, Any], cfg: dict[str, Any], ranks: int, gpu_gib: float) -> list[str]:
    """A fine-tune's layout, batch check, memory per GPU and the layout / micro batch that fit (torch-free)."""
    from snakellm import models as arch_mod
    from snakellm.models import memory

    arch, vocab = finetune_base(cfg, ft["run"])
    tp = int((ft.get("parallel") or {}).get("tp", 1))
    recompute = str((ft.get("parallel") or {}).get("recompute", "none"))
    fsdp = bool((ft.get("parallel") or {}).get("fsdp", False))
    train, ex, lora = ft["train"], ft.get("examples") or {}, ft.get("lora") or {}
    arch_mod.check_parallel(arch, tp, 1)
    if ranks % tp:
        raise ValueError(f"{ranks} ranks are not divisible by tp {tp}")
    dp = ranks // tp
    gbs, mbs = int(train["global_batch_size"]), int(train.get("micro_batch_size", 4))
    if gbs % (mbs * dp):
        raise ValueError(f"global batch size {gbs} is not divisible by micro batch size {mbs} x dp {dp}")
    seq = int(ex.get("max_seq_length") or arch["seq_length"])
    method = ft["method"]
    rank, targets = int(lora.get("rank", 32)), tuple(lora.get("targets") or ("linear_qkv",))
    what = f"lora rank {rank} on {', '.join(targets)}" if method == "lora" else method
    out = [
        f"finetune {name} ({what}, base {ft['run']}): {plural(ranks, 'rank')}; tp {tp} x dp {dp}; global batch {gbs} = micro "
        f"batch {mbs} x dp {dp} x {gbs // (mbs * dp)} accumulation steps; sequence {seq}"
        + (" (packed)" if ex.get("packing") else "")
    ]
    if not vocab:
        return out + ["  memory: the base's tokenizer names no vocab_size; not estimated"]
    padded = arch_mod.padded_vocab_size(int(vocab), arch, tp)
    out.append(f"  model: {arch_mod.describe(arch, padded)}")
    est = memory.finetune_estimate(
        arch,
        padded,
        method,
        tp=tp,
        dp=dp,
        micro_batch_size=mbs,
        seq_length=seq,
        lora_rank=rank,
        lora_targets=targets,
        recompute=recompute,
        fsdp=fsdp,
    )
    out += ["  " + line for line in est.lines(gpu_gib)]
    advise = functools.partial(
        memory.advise_finetune,
        arch,
        padded,
        method,
        ranks=ranks,
        global_batch_size=gbs,
        seq_length=seq,
        gpu_gib=gpu_gib,
        lora_rank=rank,
        lora_targets=targets,
    )
    best, configured = advise(), (tp, mbs, recompute, fsdp)
    if best is None:
        return out + [
            f"  advice: no layout of {ranks} GPUs fits {gpu_gib:g} GiB at sequence {seq}, even with full "
            "recomputation: more GPUs (resources), a shorter max_seq_length, or LoRA instead of full"
        ]
    out.append("  advice: " + _advice(best, configured, gpu_gib))
    if (best[0], best[3]) != (tp, fsdp) and (kept := advise(layouts=[(tp, fsdp)])):
        # the layout kept (the seed's tp 4, say): its largest micro batch, which amortises each layer's kernel
        # launches and collectives (8B LoRA at tp 4 on 4 H200s: 42% scaling per GPU at micro batch 1, 70% at 4)
        out.append(f"  at the configured tp {tp}: " + _advice(kept, configured, gpu_gib))
    return out


def _advice(layout: tuple[int, int, str, bool, Any], configured: tuple[int, int, str, bool], gpu_gib: float) -> str:
    """One advised layout: tp, FSDP, micro batch, recompute, its memory and the settings that give it."""
    from snakellm.models import memory

    t, m, rc, sh, e = layout
    keys = (
        f"parallel.tp: {t}, train.micro_batch_size: {m}"
        + (f", parallel.recompute: {rc}" if rc != "none" else "")
        + (", parallel.fsdp: true" if sh else "")
    )
    return (
        f"tp {t}{', FSDP' if sh else ''}, micro batch {m}{'' if rc == 'none' else f', recompute {rc}'}: "
        f"{e.total / memory.GiB:.2f} GiB per GPU, fits {gpu_gib:g} GiB"
        + (" (as configured)" if (t, m, rc, sh) == configured else f" ({keys})")
    )


def _documents(source: str, chunks: dict[str, list[str]], per_shard: float) -> tuple[int, bool]:
    """(documents of the source, whether counted): chunk stats where they exist, else shards x per_shard."""
    total, counted = 0.0, True
    for c, shards in chunks.items():
        try:
            with open(f"data/jsonl/{source}/{c}.stats.json", encoding="utf-8") as fh:
                total += json.load(fh)["documents"]
        except (OSError, ValueError, KeyError):
            total += len(shards) * per_shard
            counted = False
    return int(total), counted


def curate_plan(
    cfg: dict[str, Any], plans: dict[str, dict[str, list[str]]], per_shard: float, dup_fraction: float
) -> list[str]:
    """Each duplicate index: its sources, documents, and the memory of its jobs (snakellm.curate.index)."""
    from snakellm.config.checks import curate_indexes
    from snakellm.curate.index import cells, memory_per_job
    from snakellm.curate.signatures import is_datatrove, value_rows

    out: list[str] = []
    for name, members in curate_indexes(cfg).items():
        if not all(m in plans for m in members):
            continue
        cur = cfg["sources"][members[0]]["curate"]
        near = cur.get("near")
        bands = near["bands"] if near else None
        perm = value_rows(near)
        jobs = near["index_jobs"] if near else 1
        docs, counted = 0, True
        for m in members:
            n, ok = _documents(m, plans[m], per_shard)
            docs, counted = docs + n, counted and ok
        chunks = sum(len(plans[m]) for m in members)
        total, slices = cells(bands, jobs)
        per_job = memory_per_job(docs, bands, jobs, near["rows"] if is_datatrove(near) else 0)
        gib = 1024**3
        out += [
            "",
            f"index {name} (sources {', '.join(members)}): {plural(chunks, 'chunk')}, {plural(docs, 'document')} "
            f"({'from chunk stats' if counted else f'estimated at {per_shard:,.0f} a shard'})",
            f"  signatures: {chunks} jobs, {(3 + perm) * 4} B a document, {docs * (3 + perm) * 4 / gib:.1f} GiB in all",
            f"  buckets: {jobs} job(s) over {total * slices} cells ({bands or 0} bands + exact, {slices} slice(s) "
            f"a band): {per_job / gib:.2f} GiB each at most",
            f"  clustering: 1 job, ~{docs * dup_fraction * 64 / gib:.2f} GiB at a duplicate share of {dup_fraction}",
        ]
    return out


def run_plan(
    name: str, run: dict[str, Any], cfg: dict[str, Any], nodes: int, per_node: int, gpu_gib: float
) -> list[str]:
    """Model, parallel layout, batch check and memory per GPU of one run (torch-free)."""
    from snakellm import models as arch_mod
    from snakellm.models import memory

    model = dict(run.get("model") or {})
    arch = arch_mod.resolve(model.pop("preset", None), model)
    par, train = run.get("parallel") or {}, run.get("train") or {}
    tp, pp, vpp = int(par.get("tp", 1)), int(par.get("pp", 1)), int(par.get("virtual_pp", 1))
    recompute = (
        par.get("recompute", "none"),
        par.get("recompute_method", "uniform"),
        par.get("recompute_num_layers", 1),
    )
    world = nodes * per_node
    arch_mod.check_parallel(arch, tp, pp, vpp)
    arch_mod.check_recompute(arch, pp, vpp, *recompute)
    if world % (tp * pp):
        raise ValueError(f"world size {world} ({nodes} nodes x {per_node}) is not divisible by tp {tp} x pp {pp}")
    dp = world // (tp * pp)
    gbs, mbs = int(train["global_batch_size"]), int(train["micro_batch_size"])
    if gbs % (mbs * dp):
        raise ValueError(
            f"global batch size {gbs} is not divisible by micro batch size {mbs} x data-parallel size "
            f"{dp} (= {mbs * dp}; {nodes} nodes x {per_node} GPUs / (tp {tp} x pp {pp})): choose a "
            f"multiple of {mbs * dp}"
        )
    why = arch_mod.check_pipeline_batches(pp, vpp, gbs // (mbs * dp))
    if why:
        raise ValueError(f"global batch size {gbs}: {why}")
    from snakellm.models import moe

    why = moe.check_ep(arch, int(par.get("ep", 1)), world, tp, pp)
    if why:
        raise ValueError(f"parallel.ep {par.get('ep', 1)}: {why}")
    why = moe.check_tp(arch, tp, bool(par.get("sequence_parallel")), lambda k: f"parallel.{k}")
    if why:
        raise ValueError(why)
    tok = (cfg.get("tokenizers") or {}).get(run.get("tokenizer"), {})
    out = [
        f"run {name}: {plural(world, 'rank')} = {plural(nodes, 'node')} x {per_node}; tp {tp} x pp {pp} x dp {dp}; global batch {gbs} = "
        f"micro batch {mbs} x dp {dp} x {gbs // (mbs * dp)} accumulation steps"
    ]
    if not tok.get("vocab_size"):
        return out + [f"  memory: tokenizer {run.get('tokenizer')!r} names no vocab_size; not estimated"]
    vocab = arch_mod.padded_vocab_size(int(tok["vocab_size"]), arch, tp)
    out.append(f"  model: {arch_mod.describe(arch, vocab)}")
    out += [
        "  " + line
        for line in memory.report(
            arch,
            vocab,
            tp=tp,
            pp=pp,
            dp=dp,
            micro_batch_size=mbs,
            num_micro_batches=gbs // (mbs * dp),
            sequence_parallel=bool(par.get("sequence_parallel", False)),
            distributed_optimizer=bool(par.get("distributed_optimizer", False)),
            gpu_gib=gpu_gib,
            recompute=recompute[0],
            recompute_method=recompute[1],
            recompute_num_layers=int(recompute[2]),
            virtual_pp=vpp,
            fsdp=bool(par.get("fsdp", False)),
            grad_reduce_in_fp32=par.get("grad_reduce_dtype", "fp32") == "fp32",
            ep=int(par.get("ep", 1)),
        )
    ]
    return out


if __name__ == "__main__":
    sys.exit(main())
