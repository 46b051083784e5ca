"""The two-level all-reduce on its own (plugins/torch/hierarchical.py): 4 gloo ranks as 2 nodes x 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from commsched.plugins.torch.hierarchical import PHASES

WORKER = Path(__file__).resolve().parent / "hier_worker.py"


@pytest.mark.timeout(120)
def test_forty_pieces_started_at_once_are_exact_finish_in_issue_order_and_overlap_in_each_phase(ranks):
    results = ranks(4, script=WORKER, timeout=110)
    for r in results:
        assert r["finished"] and r["errors"] == {}, r
        assert r["exact"], f"rank {r['rank']}: a piece's two-level sum differs from the sum"
        assert r["in_order"], f"rank {r['rank']}: pieces finished out of their issue order"
        # pieces handed to a phase while another is in flight are issued at once (depth 2)
        assert r["max_in_flight"] == 2, r["max_in_flight"]
        assert r["threads_after_close"] == []
        # every phase timed every piece, in order: handed <= issued <= landed, and a phase is
        # handed a piece only once the phase before it saw the piece land
        phases = r["phases"]
        assert [phases[p]["pieces"] for p in PHASES] == [40, 40, 40], phases
        times = {p: {name: (step, handed, issued, landed) for name, step, handed, issued, landed in r["times"][p]}
                 for p in PHASES}
        for name, (step, handed, issued, landed) in times["reduce_scatter"].items():
            assert step == int(name[1:]) // 20
            assert handed <= issued <= landed
            for before, after in zip(PHASES, PHASES[1:], strict=False):
                assert times[before][name][3] <= times[after][name][1] <= times[after][name][2] <= times[after][name][3]
        assert sorted(phases["per_step"]) == ["0", "1"]
        for row in phases["per_step"].values():
            for p in PHASES:
                assert row[p]["pieces"] == 20 and 0 < row[p]["busy_s"] <= row[p]["window_s"] + 1e-9, row


@pytest.mark.timeout(120)
def test_a_rank_that_never_starts_a_piece_fails_it_on_the_others_by_the_timeout_naming_piece_and_phase(ranks):
    results = ranks(4, "--skip-on-rank", "3", "--timeout", "3", script=WORKER, timeout=110)
    for r in results[:3]:
        assert r["finished"], r
        error = r["errors"]["late"]
        assert error.startswith("CommschedError") and "'late'" in error, error
        assert "ran past 3 s" in error or "failed" in error, error  # our deadline, or the engine's own timeout
        assert r["elapsed"]["late"] < 3 * 3 + 5, r["elapsed"]
    for r in results:
        assert r["close_s"] < 15 and r["threads_after_close"] == [], r
