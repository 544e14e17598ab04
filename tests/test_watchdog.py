"""The hang watchdog names the rank that stopped; the rank table catches a wrong local-rank mapping."""

from __future__ import annotations

import time

import pytest

from snakellm.launch import distributed as distmod
from snakellm.launch import watchdog as wdmod


def test_rank_table_one_line_per_host_and_wrong_local_ranks_rejected():
    rows = [(2, 0, 2, "node2"), (0, 0, 2, "node1"), (3, 1, 2, "node2"), (1, 1, 2, "node1")]
    assert distmod.rank_table(rows) == "node1: ranks 0,1 (local 0,1); node2: ranks 2,3 (local 0,1)"
    with pytest.raises(distmod.LaunchError, match=r"host node2: ranks \[2, 3\] have local ranks \[0, 0\]"):
        distmod.rank_table([(0, 0, 2, "node1"), (1, 1, 2, "node1"), (2, 0, 2, "node2"), (3, 0, 2, "node2")])
    with pytest.raises(distmod.LaunchError, match="local world sizes"):
        distmod.rank_table([(0, 0, 1, "node1"), (1, 1, 1, "node1")])


def test_laggards_are_the_ranks_behind_or_silent():
    now = 1000.0
    info = {0: (5, 990.0, "node1", 0), 1: (5, 991.0, "node2", 0), 2: (4, 980.0, "node2", 1)}
    alive = {0: 999.0, 1: 999.5, 2: 999.0}
    assert wdmod.laggards(info, alive, 3, 5, now, stale=10) == [2]  # behind
    info[2] = (5, 992.0, "node2", 1)
    alive[1] = 970.0  # at the same step, but its process stopped stamping
    assert wdmod.laggards(info, alive, 3, 5, now, stale=10) == [1]
    assert wdmod.laggards(info, {r: 999.0 for r in range(3)}, 3, 5, now, stale=10) == [0, 1, 2]  # all slow alike
    assert wdmod.laggards({0: info[0]}, {0: 999.0}, 2, 5, now, stale=10) == [1]  # never beat at all
    assert "rank 2 (host node2, local rank 1): last at step 5, 8 s ago" == wdmod.describe(2, info, now)


@pytest.mark.slow
def test_watchdog_names_the_stopped_rank_through_a_real_store():
    torch = pytest.importorskip("torch")
    store = torch.distributed.HashStore()
    exits: list[int] = []
    w0 = wdmod.Watchdog(lambda: store, 0, 2, 0, timeout=1.5, exit=exits.append, poll=0.1)
    w1 = wdmod.Watchdog(lambda: store, 1, 2, 0, timeout=1.5, exit=exits.append, poll=0.1)
    try:
        for step in (1, 2):
            w0.beat(step)
            w1.beat(step)
        w0.beat(3)
        w1.stop()  # rank 1 stops (as SIGSTOP would): no step 3, no more stamps
        t0 = time.monotonic()
        while not exits and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert exits == [wdmod.EXIT_HANG]
        assert 1.4 < time.monotonic() - t0 < 5
        assert "rank 0 made no progress for" in w0.message and "at step 3" in w0.message
        assert "hanging: rank 1 (host " in w0.message and "last at step 2" in w0.message
    finally:
        w0.stop()
        w1.stop()


@pytest.mark.slow  # ~7 s of waiting: the watchdog's second look takes at least 5 s
def test_progress_during_the_second_look_is_no_hang():
    """A start-up longer than the timeout (checkpoint load on a busy node) that ends while the watchdog looks
    at the other ranks: the first beat after it is progress, not a hang (a retried Slurm step was ended so)."""
    torch = pytest.importorskip("torch")
    store = torch.distributed.HashStore()
    exits: list[int] = []
    ws = [wdmod.Watchdog(lambda: store, r, 2, 0, timeout=1.0, exit=exits.append, poll=0.1) for r in (0, 1)]
    try:
        time.sleep(2.5)  # past the timeout at step 0, every rank alive: each takes its second look (5 s)
        for w in ws:
            w.beat(30)  # the resumed run's first step
        time.sleep(4.5)  # the second look ends
        assert exits == [], [w.message for w in ws]
        for w in ws:
            w.stop()
    finally:
        for w in ws:
            w.stop()
