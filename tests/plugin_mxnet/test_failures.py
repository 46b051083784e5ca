"""Order agreement at a small credit, and failures that must end clearly instead of hanging.

Each test launches a real dist_sync job (scheduler + server + 2 workers on loopback).
"""

from __future__ import annotations

import pytest

pytest.importorskip("mxnet")


@pytest.fixture(scope="module")
def opposite_orders(tmp_path_factory, launch):
    # Rank 1 pushes the keys in reverse order and one piece fits in the credit; one
    # job runs it with worker 0 deciding, then with 'fifo' (which ends stuck).
    run = launch(tmp_path_factory.mktemp("order"), "--mode", "order", timeout=75, grace=1)
    assert run.stray == [], f"processes left running: {run.stray}"
    assert sorted(run.results) == [0, 1], run.output[-3000:]
    return run.results


@pytest.mark.timeout(90)
def test_opposite_submission_orders_do_not_deadlock_with_worker_0_deciding(opposite_orders):
    # dist_sync answers a push once every worker sent that key: only an agreed order can finish.
    for rank in (0, 1):
        result = opposite_orders[rank]["dynamic"]
        assert result["error"] is None, result
        assert result["sums_ok"]


@pytest.mark.timeout(90)
def test_without_agreement_the_same_credit_deadlocks_and_is_reported(opposite_orders):
    # The control for the test above: 'fifo' trusts the local order, which differs
    # here, so both windows wait for keys the other worker never sends. The wait
    # must end in a CommschedTimeout naming the stuck pieces, not a hang.
    for rank in (0, 1):
        result = opposite_orders[rank]["fifo"]
        assert result["error"] is not None and result["error"].startswith("CommschedTimeout"), result
        assert "still pending" in result["error"]
        assert result["elapsed"] < result["timeout_s"] + 5  # the window's wait is bounded by timeout_s


@pytest.mark.timeout(90)
def test_a_worker_that_dies_makes_the_other_fail_clearly_and_the_launcher_stops_all(job):
    run = job("--mode", "die", "--timeout-s", "3", timeout=75, grace=12)
    assert run.returncode != 0
    assert "exited with status 3" in run.output, run.output[-3000:]  # the launcher names the dead worker
    survivor = run.results[0]
    assert survivor["error_type"] in ("CommschedTimeout", "RemoteAbort", "CommunicationError"), survivor
    assert survivor["elapsed"] < survivor["timeout_s"] + 5  # from the step rank 1 died in
    assert "CommschedTimeout" in run.output or "RemoteAbort" in run.output  # the traceback is printed
    assert run.stray == [], "the launcher left processes running"
