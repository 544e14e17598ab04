"""The training benchmarks' smokes (test_bench_smoke.TRAINING: convert, DPO, MoE, data/pipeline parallel, the
8-GPU cases, pretraining): the same check as tests/test_bench_smoke.py's, in a module of their own so that
pytest-xdist runs them beside the other module's (a module is one group, on one worker) and each module's
shared fixture stays inside its budget."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from test_bench_smoke import TRAINING, check_smoke, run_smokes


@pytest.fixture(scope="module")
def smokes(request: pytest.FixtureRequest):
    yield from run_smokes(request)


@pytest.mark.slow
@pytest.mark.parametrize("script", TRAINING)
def test_bench_smoke_prints_its_figures(script: str, smokes: dict[str, Future]):
    check_smoke(script, smokes)
