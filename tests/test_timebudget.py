"""The suite's time budget (tests/timebudget.py) fails a run that passes it, and names what did."""

from __future__ import annotations

import pytest
import timebudget

pytest_plugins = ("pytester",)

SUITE = """
import time

import pytest


@pytest.fixture(scope="module")
def shared():
    time.sleep(0.4)


def test_quick():
    pass


def test_slow_call():
    time.sleep(0.4)


def test_slow_shared_fixture_is_not_its_own_time(shared):
    pass
"""

CONFTEST = """
import timebudget

pytest_addoption = timebudget.pytest_addoption
pytest_configure = timebudget.pytest_configure
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_suite=SUITE)
    monkeypatch.setattr(timebudget, "PER_TEST_S", 0.3)
    monkeypatch.setattr(timebudget, "SHARED_FIXTURE_S", 0.3)
    return pytester


@pytest.mark.slow  # a pytest run in a subprocess: the slow tier (fast-tier budget)
def test_over_budget_fails_the_run_naming_the_test_the_fixture_and_the_fast_tier(suite, monkeypatch):
    monkeypatch.setenv("SNAKELLM_TIME_BUDGET", "1")
    monkeypatch.setattr(timebudget, "FAST_TIER_S", 0.0)
    result = suite.runpytest_inprocess("-p", "no:cacheprovider", "-m", timebudget.FAST_TIER)
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # every test passed: the budget failed the run
    result.assert_outcomes(passed=3)
    out = result.stdout.str()
    assert "time budget exceeded" in out
    assert "test_slow_call took" in out and "test_quick took" not in out
    # the fixture's setup is its own line, not the time of the test that happened to build it
    assert "the module fixture shared" in out and "test_slow_shared_fixture_is_not_its_own_time took" not in out
    assert 'the fast tier (-m "not slow and not slurm") took' in out


@pytest.mark.slow  # a pytest run in a subprocess: the slow tier (fast-tier budget)
def test_within_budget_or_not_enforced_passes(suite, monkeypatch):
    monkeypatch.setattr(timebudget, "PER_TEST_S", 60.0)
    monkeypatch.setattr(timebudget, "SHARED_FIXTURE_S", 60.0)
    monkeypatch.setenv("SNAKELLM_TIME_BUDGET", "1")
    assert suite.runpytest_inprocess("-p", "no:cacheprovider").ret == pytest.ExitCode.OK
    monkeypatch.setattr(timebudget, "PER_TEST_S", 0.3)
    monkeypatch.setenv("SNAKELLM_TIME_BUDGET", "0")  # reported, not enforced
    result = suite.runpytest_inprocess("-p", "no:cacheprovider", "--times-report", "3")
    assert result.ret == pytest.ExitCode.OK
    assert "slowest shared fixture setups" in result.stdout.str()


@pytest.mark.slow  # a pytest run in a subprocess: the slow tier (fast-tier budget)
def test_tests_mode_fails_on_a_test_and_only_reports_the_fast_tier(suite, monkeypatch):
    monkeypatch.setattr(timebudget, "FAST_TIER_S", 0.0)
    monkeypatch.setenv("SNAKELLM_TIME_BUDGET", "tests")
    result = suite.runpytest_inprocess("-p", "no:cacheprovider", "-m", timebudget.FAST_TIER)
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # test_slow_call is over its 0.3 s
    out = result.stdout.str()
    assert "test_slow_call took" in out
    assert (
        "time budget exceeded (reported, not enforced" in out and 'the fast tier (-m "not slow and not slurm")' in out
    )
    # within the per-test limits, the fast tier's excess alone is reported and the run passes
    monkeypatch.setattr(timebudget, "PER_TEST_S", 60.0)
    monkeypatch.setattr(timebudget, "SHARED_FIXTURE_S", 60.0)
    result = suite.runpytest_inprocess("-p", "no:cacheprovider", "-m", timebudget.FAST_TIER)
    assert result.ret == pytest.ExitCode.OK
    assert "time budget exceeded (reported, not enforced" in result.stdout.str()
