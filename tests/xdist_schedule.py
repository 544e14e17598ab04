"""How the suite spreads over pytest-xdist workers (`-n 2 --dist loadgroup`, as `.ci/run` runs it).

Each test gets an ``xdist_group``; a group runs whole on one worker, so everything a group shares
is built once:

- ``slurm``: the Slurm cluster tests (one cluster, module fixtures built on it in order);
- ``default-workflow``: every test that uses the session's `default_workflow` build (one build
  per worker session: in one group it is built once, and the tests that run further targets in it
  never run Snakemake in the same directory at once);
- otherwise the test's module, so that a module's fixtures are built once.

The groups are handed out in the order below (longest first, so that the long ones overlap: the
Slurm tests mostly wait for the cluster, while the other worker computes); the rest follow in
collection order. Without xdist nothing changes.
"""

from __future__ import annotations

import pytest

# Groups handed out first, longest first (xdist gives a worker its next group when at most 2 tests of
# its current one are left: the Slurm group and the default-workflow group start at once, one a worker).
FIRST = ["slurm", "default-workflow", "test_docs.py"]
# Then the modules that take longest (measured on 2 cores; the order only balances the workers)
LONG = [
    "test_nemo_compat.py",
    "test_bench_smoke.py",
    "test_bench_smoke_training.py",
    "test_engine_kernels.py",
    "test_lora_chain.py",
    "test_dpo.py",
    "test_tokenizer_json.py",
    "test_hf_workflow.py",
    "test_report.py",
    "test_serve.py",
    "test_chunk_inputs.py",
    "test_train.py",
    "test_pipeline_cpu.py",
    "test_hf.py",
    "test_incremental.py",
    "test_tokenize_workflow.py",
    "test_mediawiki.py",
    "test_examples.py",
    "test_download.py",
]


def group_of(item: pytest.Item) -> str:
    if item.get_closest_marker("slurm"):
        return "slurm"
    if "default_workflow" in getattr(item, "fixturenames", ()):
        return "default-workflow"
    return item.path.name


def under_xdist(config: pytest.Config) -> bool:
    return config.getoption("dist", "no") not in ("no", None) or hasattr(config, "workerinput")


def _suffix_group(item: pytest.Item, group: str) -> None:
    """What xdist's worker does for an ``xdist_group`` mark: ``nodeid@group`` (its scheduler's unit).

    pytest-xdist 3.8 writes ``item._nodeid``, which pytest 9 no longer reads (the node id is
    ``item._id``, a structured id), so the groups would be silently ignored; set it here instead.
    """
    try:
        from _pytest.nodeid import NodeId, coerce_node_id
    except ImportError:  # pytest < 9: xdist's own hook does it
        return
    if isinstance(getattr(item, "_id", None), NodeId) and not item.nodeid.endswith(f"@{group}"):
        item._id = coerce_node_id(f"{item.nodeid}@{group}")


class Schedule:
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if not under_xdist(config):
            return
        order = {g: i for i, g in enumerate(FIRST + LONG)}
        groups = {id(item): group_of(item) for item in items}
        for item in items:
            item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
            _suffix_group(item, groups[id(item)])
        items.sort(key=lambda item: order.get(groups[id(item)], len(order)))  # stable: collection order within


def pytest_configure(config: pytest.Config) -> None:
    if under_xdist(config):
        # hand the groups out in the order above, not by their number of tests
        config.option.loadscopereorder = False
    config.pluginmanager.register(Schedule(), "snakellm-schedule")
