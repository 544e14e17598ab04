"""The suite's time budget, and where its time goes (a pytest plugin, loaded by tests/conftest.py).

Every test phase (setup, call, teardown) is timed twice: wall clock, and the CPU time of the test
process plus the subprocesses it waited for (``getrusage``). Wall time says what a developer waits;
CPU time says what a test costs on a shared machine, where wall times are inflated by whatever else
runs (a test whose CPU time is far below its wall time is waiting: sleeps, servers, Slurm's timers).

- ``--times-report N`` (or ``SNAKELLM_TIMES_REPORT=N``) prints, after the run, the N slowest shared
  fixture setups (module/session scope: the default workflow, the Slurm cluster, a module's model;
  the first test that needs one builds it) and the N slowest test setups and calls.
- ``SNAKELLM_TIMES_JSON=path`` writes every phase's times there (one record per test).
- ``SNAKELLM_TIME_BUDGET=1`` (the budget is for the CI machine, 2 cores) makes
  the session fail when, outside the Slurm tests, a test's own time (its function-scoped setup, call
  and teardown) passes ``PER_TEST_S`` seconds or a shared fixture's setup passes ``SHARED_FIXTURE_S``,
  or when a run of the fast tier (``-m "not slow and not slurm"``) takes more than ``FAST_TIER_S``
  seconds from start to end (collection included). The next slow test or fixture is then noticed by
  the change that adds it. ``SNAKELLM_TIME_BUDGET=tests`` enforces the per-test and shared-fixture limits
  and reports the fast tier's total; ``0`` (or unset) reports every excess and fails nothing.

Works under pytest-xdist: the workers attach the CPU times to their reports; the controller checks.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import time
from pathlib import Path

import pytest

COUNTS = pytest.StashKey[dict]()
PER_TEST_S = 120.0
SHARED_FIXTURE_S = 600.0  # the default workflow (every stage of the shipped config) is built once, in a few minutes
FAST_TIER_S = 90.0
FAST_TIER = "not slow and not slurm"


def whole_suite(config: pytest.Config) -> bool:
    """Whether this session collected every test (no file or node arguments: the testpaths)."""
    return config.args_source == pytest.Config.ArgsSource.TESTPATHS or all(
        Path(a).resolve() == Path(config.rootpath, "tests").resolve() for a in config.args
    )


def _cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--times-report",
        type=int,
        default=int(os.environ.get("SNAKELLM_TIMES_REPORT", "0") or 0),
        help="print the N slowest fixture setups and tests, wall and CPU time (snakellm)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(TimeBudget(config), "snakellm-timebudget")


class TimeBudget:
    def __init__(self, config: pytest.Config):
        self.config = config
        self.start = time.monotonic()
        self.records: dict[str, dict] = {}
        self.failures: list[str] = []
        # "1": every limit fails the run; "tests": the per-test and shared-fixture limits do, the fast tier's
        # total is reported; "0" or unset: everything is reported, nothing fails
        mode = os.environ.get("SNAKELLM_TIME_BUDGET", "")
        self.enforce = mode not in ("", "0")
        self.enforce_tier = self.enforce and mode != "tests"
        self.tier_over: str | None = None

    # ------------------------------------------------------------------ the collection's counts (docs/testing.md)
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Count the tiers before ``-m``/``-k`` deselect anything (tests/test_testing_doc.py reads them)."""
        tiers = collections.Counter(
            "slurm" if it.get_closest_marker("slurm") else "slow" if it.get_closest_marker("slow") else "fast"
            for it in items
        )
        counts = {"total": len(items), "fast": tiers["fast"], "slow": tiers["slow"], "slurm": tiers["slurm"]}
        counts["whole_suite"] = whole_suite(config)
        config.stash[COUNTS] = counts
        if os.environ.get("SNAKELLM_COUNTS_JSON"):
            Path(os.environ["SNAKELLM_COUNTS_JSON"]).write_text(json.dumps(counts))

    # ------------------------------------------------------------------ measuring (where the test runs)
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        item._snakellm_cpu0 = _cpu()  # type: ignore[attr-defined]
        item._snakellm_shared = []  # type: ignore[attr-defined]
        self.item = item
        yield
        self.item = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
        """Time the shared (module, class, package, session scoped) fixtures apart: the first test that
        needs one pays for its setup, which is not that test's own time."""
        t0, c0 = time.monotonic(), _cpu()
        yield
        item = getattr(self, "item", None)
        if item is not None and fixturedef.scope != "function":
            wall, cpu = time.monotonic() - t0, _cpu() - c0
            item._snakellm_shared.append((fixturedef.argname, fixturedef.scope, round(wall, 3), round(cpu, 3)))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        item._snakellm_cpu0 = _cpu()  # type: ignore[attr-defined]
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item):
        item._snakellm_cpu0 = _cpu()  # type: ignore[attr-defined]
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        outcome = yield
        report = outcome.get_result()
        t0 = getattr(item, "_snakellm_cpu0", None)
        if t0 is not None:
            report.cpu_s = round(_cpu() - t0, 3)  # travels with the report to xdist's controller
        if call.when == "setup":
            report.shared_fixtures = list(getattr(item, "_snakellm_shared", []))

    # ------------------------------------------------------------------ collecting (controller or plain run)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if hasattr(self.config, "workerinput"):
            return
        rec = self.records.setdefault(
            report.nodeid,
            {"nodeid": report.nodeid, "slurm": "slurm" in report.keywords, "slow": "slow" in report.keywords},
        )
        rec[report.when] = round(report.duration, 3)
        rec[f"{report.when}_cpu"] = getattr(report, "cpu_s", None)
        if report.when == "setup":
            shared = [tuple(f) for f in getattr(report, "shared_fixtures", [])]
            rec["shared_fixtures"] = shared
            # the test's own setup: its function-scoped fixtures, without the shared ones it happened to build
            rec["own_setup"] = round(max(0.0, report.duration - sum(f[2] for f in shared)), 3)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(self.config, "workerinput"):
            return
        wall = time.monotonic() - self.start
        path = os.environ.get("SNAKELLM_TIMES_JSON")
        if path:
            with open(path, "w") as f:
                json.dump({"session_s": round(wall, 1), "tests": list(self.records.values())}, f, indent=0)
        for rec in self.records.values():
            own = rec.get("own_setup", rec.get("setup", 0.0)) + rec.get("call", 0.0) + rec.get("teardown", 0.0)
            if not rec["slurm"] and own > PER_TEST_S:
                self.failures.append(
                    f"{rec['nodeid']} took {own:.0f} s (its own setup {rec.get('own_setup', 0):.0f} s, call"
                    f" {rec.get('call', 0):.0f} s); the budget is {PER_TEST_S:.0f} s per test outside the Slurm tests"
                )
            for name, scope, setup_s, _cpu_s in rec.get("shared_fixtures", []):
                if not rec["slurm"] and setup_s > SHARED_FIXTURE_S:
                    self.failures.append(
                        f"the {scope} fixture {name} (first needed by {rec['nodeid']}) took {setup_s:.0f} s to set up;"
                        f" the budget is {SHARED_FIXTURE_S:.0f} s per shared fixture outside the Slurm tests"
                    )
        markexpr = (self.config.getoption("markexpr", "") or "").strip()
        if markexpr == FAST_TIER and self.records and wall > FAST_TIER_S:
            self.tier_over = (
                f'the fast tier (-m "{FAST_TIER}") took {wall:.0f} s; the budget is {FAST_TIER_S:.0f} s:'
                " make the new tests cheaper or mark the end-to-end ones slow"
            )
        failed = (self.enforce and self.failures) or (self.enforce_tier and self.tier_over)
        if failed and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        n = self.config.getoption("times_report")
        if n and self.records:
            tr = terminalreporter
            recs = list(self.records.values())

            def table(title: str, key: str) -> None:
                rows = sorted((r for r in recs if r.get(key) is not None), key=lambda r: -r[key])[:n]
                tr.write_sep("=", title)
                for r in rows:
                    cpu = r.get(f"{key}_cpu")
                    tr.write_line(
                        f"{r[key]:8.1f} s wall {cpu if cpu is not None else float('nan'):8.1f} s cpu  {r['nodeid']}"
                    )

            fixtures = sorted(
                (
                    (f[2], f[3], f"{f[0]} ({f[1]}; first needed by {r['nodeid']})")
                    for r in recs
                    for f in r.get("shared_fixtures", [])
                ),
                reverse=True,
            )[:n]
            tr.write_sep("=", f"snakellm: {n} slowest shared fixture setups")
            for wall, cpu, what in fixtures:
                tr.write_line(f"{wall:8.1f} s wall {cpu:8.1f} s cpu  {what}")
            table(f"snakellm: {n} slowest test setups (function-scoped fixtures and shared ones built there)", "setup")
            table(f"snakellm: {n} slowest test calls", "call")
        for lines, enforced in (
            (self.failures, self.enforce),
            ([self.tier_over] if self.tier_over else [], self.enforce_tier),
        ):
            if lines:
                note = "" if enforced else " (reported, not enforced: SNAKELLM_TIME_BUDGET=1 fails the run)"
                terminalreporter.write_sep("=", f"snakellm: time budget exceeded{note}", red=enforced)
                for line in lines:
                    terminalreporter.write_line(line)
