"""The overlap metric's edge cases, the per-step breakdown, decision latency and calibration (no framework)."""

from __future__ import annotations

import array
import argparse
import threading
import time

import pytest

from commsched import Scheduler, SchedulerConfig
from commsched.backends import ArrayOps, InProcessWorld
from commsched.bench.report import (
    BREAKDOWN_HEADER,
    breakdown,
    build_report,
    calibration_block,
    decision_latency,
    decisions_ahead,
    markdown,
    overlap_ratio,
    regime_of,
)
from commsched.bench.runner import PhaseResult, choose_batch_size
from commsched.costmodel.profile import handoff_from_times

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------ overlap in [0, 1]
def test_overlap_is_the_hidden_share_of_comm_from_the_bubble():
    ratio, exposed, method = overlap_ratio(comm_s=0.5, compute_s=0.6, step_s=0.7, exposed_s=0.1)
    assert ratio == pytest.approx(0.8) and exposed == 0.1 and "bubble" in method


def test_overlap_without_a_bubble_counts_the_step_beyond_compute_as_exposed():
    ratio, exposed, method = overlap_ratio(comm_s=0.5, compute_s=0.6, step_s=0.8)
    assert ratio == pytest.approx(1 - 0.2 / 0.5) and exposed == pytest.approx(0.2) and "step - compute" in method


def test_a_step_slower_than_no_overlap_is_zero_not_negative():
    # step > compute + comm: the loss is elsewhere (CPU), and overlap stays 0
    assert overlap_ratio(comm_s=0.1, compute_s=0.4, step_s=0.9)[0] == 0.0
    assert overlap_ratio(comm_s=0.1, compute_s=0.4, step_s=0.45, exposed_s=0.3)[0] == 0.0  # bubble > comm


def test_a_step_faster_than_the_bound_from_noise_is_one_not_above():
    assert overlap_ratio(comm_s=0.5, compute_s=0.6, step_s=0.55)[0] == 1.0  # step < max(compute, comm)


@pytest.mark.parametrize("comm", [0.0, 0.001, 0.018])
def test_comm_below_the_noise_floor_is_not_a_ratio(comm):
    # the loopback case that printed -7.05: comm a few ms under a 0.37 s compute (floor 5 % = 18.5 ms)
    ratio, _, method = overlap_ratio(comm_s=comm, compute_s=0.37, step_s=0.396)
    assert ratio is None and method.startswith("n/a") and "noise floor" in method


# ------------------------------------------------------------------ the breakdown
def _rank(commsched: bool, *, bubbles=None, follower_stats=None):
    n = 4
    r = {
        "step_times_s": [1.0] * n, "total_s": 4.0, "forward_s": [0.4] * n, "backward_s": [0.5] * n,
        "step_call_s": [0.05] * n, "bubble_s": bubbles, "bubble_method": "commsched" if commsched else "DDP",
        "apply_s": {"forward": [0.03 if commsched else 0.0] * n, "backward": [0.0] * n,
                    "step": [0.0 if commsched else 0.04] * n},
        "final_sync_s": 0.2, "submit_s": [0.002] * n if commsched else None,
        "sched_thread_cpu_s": {"dispatch": 0.004, "complete": 0.008} if commsched else None,
        "sched_engine_cpu_s": {"launch": 0.002, "on_done": 0.006} if commsched else None,
        "measured_pieces": 40 if commsched else None,
        "cpu": {"cpu_busy": 0.5, "process_cpu_s": 1.0, "wall_s": 2.0}, "checksum": "a",
        "stats": follower_stats or {}, "timeline": [],
    }
    return r


def test_breakdown_splits_the_forward_and_names_how_each_number_was_measured():
    phase = PhaseResult("dynamic", "ok", [_rank(True, bubbles=[0.1] * 4), _rank(True, bubbles=[0.2] * 4)])
    b = breakdown(phase)
    assert b["forward_wait_s"] == pytest.approx(0.2)  # the slowest rank's bubble
    assert b["forward_compute_s"] == pytest.approx(0.4 - 0.1 - 0.03)  # rank 0's is the larger
    assert b["per_rank"][1]["forward_compute_s"] == pytest.approx(0.4 - 0.2 - 0.03)
    assert b["optimizer_apply_s"] == pytest.approx(0.03) and b["apply_in_forward_s"] == pytest.approx(0.03)
    assert b["other_s"] == pytest.approx(1.0 - 0.4 - 0.5 - 0.05)
    assert b["sched_cpu_s"] == pytest.approx(0.012 / 4)
    assert b["sched_cpu_per_piece_s"] == pytest.approx(0.012 / 40)
    assert b["sched_cpu_by_thread_s"] == {"complete": pytest.approx(0.002), "dispatch": pytest.approx(0.001)}
    # of the 12 ms on the threads, 2 ms were launches and 6 ms the division: 4 ms over 40 pieces were its own
    assert b["sched_engine_cpu_s"] == {"launch": pytest.approx(0.0005), "on_done": pytest.approx(0.0015)}
    assert b["sched_own_cpu_per_piece_s"] == pytest.approx(0.004 / 40)
    assert b["submit_s"] == pytest.approx(0.002)
    assert all(key in b["how"] for key in b if key not in ("per_rank", "how"))


def test_breakdown_of_a_peer_waits_nowhere_in_forward_and_shows_its_step_wait():
    b = breakdown(PhaseResult("ddp:1", "ok", [_rank(False), _rank(False)]))
    assert b["forward_wait_s"] == 0 and b["forward_compute_s"] == pytest.approx(0.4)
    assert b["step_wait_s"] == pytest.approx(0.05 - 0.04) and b["sched_cpu_s"] is None
    assert b["decision_latency"] is None


def test_breakdown_of_the_synchronous_path_puts_its_wait_in_step_not_in_the_forward():
    """``sync`` (or ``auto`` settled on cross_iteration=False): the bubble is step()'s wait for the reductions."""
    ranks = [_rank(True, bubbles=[0.03] * 4, follower_stats={"cross_iteration": False}) for _ in range(2)]
    b = breakdown(PhaseResult("sync", "ok", ranks))
    assert b["forward_wait_s"] == 0 and b["forward_compute_s"] == pytest.approx(0.4 - 0.03)
    cross = breakdown(PhaseResult("fifo", "ok", [_rank(True, bubbles=[0.03] * 4) for _ in range(2)]))
    assert cross["forward_wait_s"] == pytest.approx(0.03)


def test_decisions_ahead_reads_rank0s_counts_and_an_older_worker_has_none():
    ahead = decisions_ahead({"scheduler": {"pieces": 20, "decided_ahead": 15, "published_batches": 4}})
    assert ahead == {"pieces": 20, "ahead_share": 0.75, "pieces_per_batch": 5.0}
    assert decisions_ahead({"scheduler": {"pieces": 20}}) is None
    assert decisions_ahead({"pieces": 0, "decided_ahead": 0, "published_batches": 0}) == {
        "pieces": 0, "ahead_share": 0.0, "pieces_per_batch": None}


def test_the_report_prints_the_breakdown_table():
    base = {"param_bytes": 1000, "num_params": 250, "layers": [], "forward_s": [0.2] * 3,
            "backward_s": [0.4] * 3, "optimizer_s": [0.05] * 3, "one_worker_s": [0.6] * 3,
            "comm_s": [0.5] * 3, "comm_cpu": {"cpu_busy": 0.5, "process_cpu_s": 1.0, "wall_s": 2.0},
            "forward_under_comm_s": [0.25] * 3, "backward_under_comm_s": [0.45] * 3,
            "optimizer_under_comm_s": [0.05] * 3, "under_comm_span_s": [[0.75, 0.5]] * 3}
    config = {"workload": "balanced", "workers": 2, "nodes": 2, "bandwidth": "1gbit", "intra_bandwidth": None,
              "strategies": [], "steps": 4, "warmup": 1, "baseline_steps": 3, "batch_size": 8,
              "partition_bytes": 1, "credit_bytes": 1, "network": "netns", "seed": 0, "extra": {}}
    phases = [PhaseResult("dynamic", "ok", [_rank(True, bubbles=[0.1] * 4), _rank(True, bubbles=[0.1] * 4)])]
    report = build_report(config, "netns", "note", {"name": "balanced"}, PhaseResult("baseline", "ok", [base, base]),
                          phases, calibration={"expected": "balanced"})
    table = markdown(report)
    assert BREAKDOWN_HEADER in table
    assert "| dynamic | 1000.0 | 270.0 | 100.0 | 30.0 | 500.0 (2.0) |" in table
    # compute 0.65 vs comm 0.5: 1.3 is compute-bound, not the balanced the name promises
    assert report["calibration"]["measured_regime"] == "compute-bound"
    assert any("meant to be balanced but measured compute-bound" in w for w in report["warnings"])
    assert "regime: meant balanced, measured compute-bound (compute / comm 1.30)" in table


# ------------------------------------------------------------ decision latency, measured
def _doubles(n):
    return array.array("d", [1.0] * n)


def test_issue_times_let_the_report_measure_decision_to_follower_issue():
    """Two thread-ranks under dynamic, one 64-byte piece in flight at a time; the follower's gradients
    are ready only after rank 0 decided its first piece, so that piece waited for data there, and rank 0's
    later pieces waited for credit after their data was ready (ready_at < issued_at)."""
    world = InProcessWorld(2)
    # decide_ahead off: a decision per piece as it starts (ahead, the rest of an ended step travels before
    # rank 0 starts it, and the follower may issue first: a latency of zero or less)
    cfg = SchedulerConfig(partition_bytes=64, credit_bytes=64, ordering="dynamic", timeout_s=10, decide_ahead=False)
    leader_done = threading.Event()  # rank 0 decided its first piece
    scheds = [Scheduler(world.backend(0), ArrayOps(), cfg, store=world.store, observer=lambda *_: leader_done.set()),
              Scheduler(world.backend(1), ArrayOps(), cfg, store=world.store)]
    try:
        def follower():
            assert leader_done.wait(10)
            for _ in range(2):
                scheds[1].submit("a", _doubles(32))
                scheds[1].submit("b", _doubles(8))
                scheds[1].mark_step()
            scheds[1].synchronize(timeout=10)

        t = threading.Thread(target=follower)
        t.start()
        for _ in range(2):
            scheds[0].submit("a", _doubles(32))
            scheds[0].submit("b", _doubles(8))
            scheds[0].mark_step()
        scheds[0].synchronize(timeout=10)
        t.join(10)
        stats = [s.stats() for s in scheds]
    finally:
        for s in scheds:
            s.close()
        world.close()
    for st in stats:
        for step, seen in st["per_step"].items():
            assert len(st["issue_times"][step]["issued_at"]) == len(seen["order"]) == 5  # a: 4 pieces, b: 1
    lat = decision_latency(stats[0], stats[1:])
    assert lat["pieces"] == 10 and lat["steps"] == ["0", "1"]
    assert lat["latency_s"]["p50"] > 0 and lat["data_wait_s"]["max"] > 0
    assert lat["control_s"]["max"] >= 0 and lat["latency_s"]["max"] >= lat["data_wait_s"]["max"]
    lead = stats[0]["issue_times"]
    waited = [i - r for t in lead.values() for i, r in zip(t["issued_at"], t["ready_at"], strict=True)]
    assert min(waited) >= 0 and max(waited) > 0.001  # held back by credit until the follower joined
    # every piece landed after it was issued, and with one in flight before the next one was issued
    for st in stats:
        for times in st["issue_times"].values():
            landed, issued = times["landed_at"], times["issued_at"]
            assert None not in landed and all(a >= i for a, i in zip(landed, issued, strict=True))
            assert all(a <= i for a, i in zip(landed, issued[1:], strict=False))
    handoff = handoff_from_times(stats)
    assert handoff["pairs"] > 0 and handoff["value"] >= 0


# ------------------------------------------------------------------ calibration
def test_regimes_by_compute_over_comm():
    assert regime_of(0.39, 0.58) == "comm-bound"  # the issue's balanced on a faster CPU
    assert regime_of(0.55, 0.5) == "balanced" and regime_of(1.0, 0.2) == "compute-bound"
    assert regime_of(None, 0.5) is None
    block = calibration_block("balanced", {"compute_s": 0.5, "comm_s": 0.5})
    assert block["matches"] is True and block["target_compute_over_comm"] == 1.0


def test_choose_batch_size_fits_a_line_through_two_trials():
    one = [{"batch_size": 512, "compute_s": 0.4, "comm_s": 0.6}]
    assert choose_batch_size(one, 1.0, 512) == 768  # proportional: 512 * 0.6 / 0.4
    # compute = 0.1 + 0.0005 * b: b = (0.6 - 0.1) / 0.0005 = 1000
    two = [*one, {"batch_size": 768, "compute_s": 0.1 + 0.0005 * 768, "comm_s": 0.6}]
    two[0]["compute_s"] = 0.1 + 0.0005 * 512
    assert choose_batch_size(two, 1.0, 512) == 1000
    assert choose_batch_size(one, 1000.0, 512) == 512 * 16  # clamped
    assert choose_batch_size([{"batch_size": 4, "compute_s": 9.0, "comm_s": 0.1}], 0.5, 4) == 1
    with pytest.raises(ValueError, match="at least one"):
        choose_batch_size([], 1.0, 8)


@pytest.mark.parametrize(("argv", "fix"), [
    (["--workload", "balanced", "--calibrate", "--batch-size", "64"], "drop --batch-size 64"),
    (["--workload", "tiny", "--calibrate"], "pass --batch-size instead"),
    (["--workload", "tiny", "--batch-size", "0"], "--batch-size must be >= 1"),
])
def test_bad_calibration_arguments_exit_2_naming_the_fix(argv, fix, capsys):
    pytest.importorskip("torch")
    from commsched.bench import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args([*argv, "--json", "/nonexistent/never.json"])) == 2
    assert fix in capsys.readouterr().err


def test_submit_is_timed_on_the_scheduler_in_use_after_auto_replaced_the_first():
    """``auto`` replaces its scheduler at each switch: the bench times ``submit`` of the one it
    settled on (``StepTimers.watch``), and the first one is left as it was."""
    pytest.importorskip("torch")
    from commsched.plugins.torch.bench.worker import StepTimers

    class Sched:
        def __init__(self):
            self.calls = 0

        def submit(self, *args, **kwargs):
            self.calls += 1
            return "future"

    first, settled = Sched(), Sched()
    strat = type("Strat", (), {"optimizer": type("Opt", (), {"_scheduler": first})()})()
    timers = StepTimers(strat, None)
    try:
        assert first.submit("g") == "future" and "submit" in first.__dict__  # timed
        timers.watch(settled)
        assert "submit" not in first.__dict__ and "submit" in settled.__dict__
        timers.take()
        assert settled.submit("g") == "future" and settled.calls == 1
        _, submit_s = timers.take()
        assert submit_s > 0
        first.submit("g")  # no longer counted
        assert timers.take()[1] == 0.0
    finally:
        timers.close()
    assert "submit" not in settled.__dict__


def _cross_iteration_trainer(monkeypatch, drain_s):
    """A worker's ``_Trainer`` around a stand-in strategy whose communication is ``drain_s`` of work
    still in flight after each step (as under cross-iteration): the next forward waits for it, or a
    synchronize() does. No process group: the barrier is a no-op."""
    torch = pytest.importorskip("torch")
    from commsched.plugins.torch.bench import worker
    from commsched.plugins.torch.bench.worker import StepTimers, _Trainer

    monkeypatch.setattr(worker, "_barrier", lambda: None)

    class Strat:
        bubble_method = "stand-in"

        def __init__(self, model):
            self.model, self.optimizer, self.in_flight, self.steps = model, None, False, 0

        def _land(self):
            if self.in_flight:
                time.sleep(drain_s)
                self.in_flight = False

        def zero_grad(self):
            self._land()  # the next forward needs the last step's communication

        def step(self):
            self.in_flight, self.steps = True, self.steps + 1

        synchronize = _land

        def mark_measured(self):
            self.first = self.steps

        def bubble_per_step(self):
            return [0.0] * (self.steps - self.first)

        def stats(self):
            return {}

    model = torch.nn.Linear(4, 2)
    trainer = object.__new__(_Trainer)
    trainer.sspec = type("Spec", (), {"is_commsched": False, "kind": "ddp"})()
    trainer.workload = type("W", (), {"loss": staticmethod(lambda out, y: ((out - y) ** 2).mean())})()
    trainer.model, trainer.x, trainer.y = model, torch.ones(3, 4), torch.zeros(3, 2)
    trainer.strat = Strat(model)
    trainer.timers = StepTimers(trainer.strat, None)
    trainer.starts, trainer.phases, trainer.applies, trainer.submits = [], [], [], []
    return trainer


def test_an_interleaved_turn_measures_steady_steps_and_a_phase_its_ends(monkeypatch):
    """Under cross-iteration a phase's first measured step waits on nothing and its last ends when its
    communication has landed; an interleaved turn (``steady``) goes on from the lead step and ends its last
    step where the trail step starts: every one of its steps waits once for its predecessor's communication."""
    drain = 0.05
    trainer = _cross_iteration_trainer(monkeypatch, drain)
    try:
        trainer.step()  # warm-up
        phase = trainer.measure(3, lambda *a: None)
        assert phase["step_times_s"][0] < drain  # nothing in flight at its start
        assert phase["step_times_s"][-1] >= drain  # its own communication, drained
        trainer.step()  # the lead step of a turn
        turn = trainer.measure(3, lambda *a: None, steady=True)
        assert len(turn["step_times_s"]) == 3 and len(turn["forward_s"]) == 3 and len(turn["bubble_s"]) == 3
        assert all(t >= drain for t in turn["step_times_s"])  # each waited for the step before
        assert turn["total_s"] == pytest.approx(sum(turn["step_times_s"]))
        assert turn["final_sync_s"] >= drain  # the trail's communication, drained after the turn
        assert not trainer.strat.in_flight
    finally:
        trainer.timers.close()
