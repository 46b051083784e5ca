"""Report arithmetic on synthetic phase results: definitions, bubble estimates, skips (no framework needed)."""

from __future__ import annotations

import pytest

from commsched.bench.report import (
    build_report,
    comm_contention,
    markdown,
    quantile,
)
from commsched.bench.runner import PhaseResult

from bench_phases import CONFIG, DDP, HVD, baseline_rank as _baseline_rank, train_rank as _train_rank

def _report(phases):
    baseline = PhaseResult("baseline", "ok", [_baseline_rank(0), _baseline_rank(1)])
    return build_report(CONFIG, "netns", "note", {"name": "tiny"}, baseline, phases)


def test_baseline_bounds_follow_their_definitions():
    base = _report([])["baseline"]
    assert base["compute_s"] == pytest.approx(0.65)
    assert base["lower_bound_s"] == pytest.approx(0.65)  # max(compute 0.65, comm 0.5)
    assert base["no_overlap_s"] == pytest.approx(1.15)
    # backward 0.4 < comm 0.5: DDP pays forward + comm + optimizer
    assert base["ddp_model_s"] == pytest.approx(0.2 + 0.5 + 0.05)
    assert base["ceiling_speedup_vs_ddp"] == pytest.approx((0.2 + 0.5 + 0.05) / 0.65)
    assert base["compute_under_comm_s"] == pytest.approx(0.75)
    assert base["contended_bound_s"] == pytest.approx(0.75)  # max(compute under comm 0.75, comm 0.5)
    assert base["under_comm_coverage"] == pytest.approx(0.5 / 0.75)
    # the all-reduce (0.5 s alone) ended at 0.5 s, all of it beside compute: not slowed
    assert base["comm_under_compute_s"] == pytest.approx(0.5) and base["comm_contention"] == pytest.approx(1.0)
    assert base["comm_workers_cpu_busy"] == pytest.approx(2 * 1.0 / 2.0 / _cpus())


def test_contention_without_the_stream_phase_is_corrected_for_the_all_reduce_s_coverage():
    # compute 0.65 alone, 0.75 beside one all-reduce that ended at 0.5 s (coverage 2/3): 0.5 s ran
    # kappa times slower, 0.5 / kappa of work done, the other 0.65 - 0.5 / kappa after it at full speed
    base = _report([])["baseline"]
    assert base["stream_allreduces"] is None and base["compute_under_stream_s"] is None
    assert base["contention"] == pytest.approx(1.25)
    assert 0.5 + (0.65 - 0.5 / base["contention"]) == pytest.approx(0.75)


def _streamed(alone, under, span):
    ranks = [_baseline_rank(0), _baseline_rank(1)]
    for r in ranks:
        r["stream"] = {"count": 3, "alone_s": [alone] * 3, "under_s": [under] * 3, "span_s": [span] * 3}
    return build_report(CONFIG, "netns", "note", {"name": "tiny"}, PhaseResult("baseline", "ok", ranks), [])


def test_contention_comes_from_the_stream_phase_where_it_ran():
    # beside a stream that outlasted it (ended at 1.2 s, compute at 1.0): 1.0 / 0.65
    base = _streamed([0.2, 0.4, 0.05], [0.3, 0.6, 0.1], [1.0, 1.2])["baseline"]
    assert base["stream_allreduces"] == 3 and base["stream_coverage"] == 1.0
    assert base["stream_alone_s"] == pytest.approx(0.65) and base["compute_under_stream_s"] == pytest.approx(1.0)
    assert base["contention"] == pytest.approx(1.0 / 0.65)
    # the compute-beside-one-all-reduce fields, the contended bound's, are the phase before's
    assert base["compute_under_comm_s"] == pytest.approx(0.75)


def test_contention_from_a_stream_that_ended_first_is_corrected_for_its_coverage():
    # the stream ended at 0.5 s of the 1.0: 0.5 s slowed, then 0.65 - 0.5 / kappa at full speed
    base = _streamed([0.2, 0.4, 0.05], [0.3, 0.6, 0.1], [1.0, 0.5])["baseline"]
    assert base["stream_coverage"] == pytest.approx(0.5)
    kappa = base["contention"]
    assert 0.5 + (0.65 - 0.5 / kappa) == pytest.approx(1.0) and kappa == pytest.approx(0.5 / 0.15)


def _layered_baseline():
    """Rank 0 with two layers of 500 bytes, 10 ms of forward each (alone), ready 100 and 50 ms into
    backward; the baseline phase of both ranks."""
    r0 = _baseline_rank(0)
    r0["layers"] = [{"layer": "0:Linear", "param_bytes": 500, "forward_ms": 10.0, "grad_ready_ms": 100.0},
                    {"layer": "1:Linear", "param_bytes": 500, "forward_ms": 10.0, "grad_ready_ms": 50.0}]
    return PhaseResult("baseline", "ok", [r0, _baseline_rank(1)])


def _commsched(name, step):
    return PhaseResult(name, "ok", [_train_rank([step] * 4, "commsched", bubbles=[0.1] * 4),
                                    _train_rank([step] * 4, "commsched", bubbles=[0.1] * 4)])


def test_the_dependency_bound_comes_from_rank_0s_layers_scaled_to_the_baseline():
    # scaled to the baseline's forward 0.2 and backward 0.4, the link's 0.5 s split by bytes, the
    # optimizer's 0.05 s too. Layer 0: ready 0.4, its 0.25 s of link, then the next forward
    # (0.2) and layer 1's update (0.025); layer 1: 0.2 + 0.5 + 0.1; compute 0.65, comm 0.5.
    report = build_report(CONFIG, "netns", "note", {"name": "tiny"}, _layered_baseline(),
                          [_commsched("dynamic", 1.0)])
    base = report["baseline"]
    assert base["dependency_bound_s"] == pytest.approx(0.4 + 0.25 + 0.2 + 0.025)
    assert base["dependency_layer"] == "0:Linear"
    # the larger of it and the contended bound (compute under a concurrent all-reduce 0.75)
    assert base["combined_bound_s"] == pytest.approx(0.875)
    (entry,) = report["results"]
    assert entry["efficiency_combined"] == pytest.approx(0.875 / 1.0)
    text = markdown(report)
    assert "- dependency bound 0.875 s: the next forward needs every layer up to 0:Linear reduced" in text
    assert "(+35% on max(compute, comm))" in text  # 0.875 against 0.65
    assert "contended bound 0.875 s" in text
    assert "| 0.65 (0.75; 0.88) |" in text  # efficiency (contended; combined)
    # without a per-layer profile (TensorFlow, MXNet) the fields are null and the table as before
    plain = _report([])["baseline"]
    assert plain["dependency_bound_s"] is None and plain["combined_bound_s"] is None


def test_no_combined_efficiency_where_a_strategy_changes_what_the_bound_assumes():
    # splitting the tied embedding reduces most of its gradient early
    (tied,) = build_report(CONFIG, "netns", "note", {"name": "tiny"}, _layered_baseline(),
                           [_commsched("dynamic+tied", 0.8)])["results"]
    assert tied["efficiency_combined"] is None and tied["efficiency_contended"] == pytest.approx(0.75 / 0.8)
    # on two nodes of two ranks a strategy that may run the two-level algorithm moves fewer bytes than
    # the bound's flat all-reduce: none for planned, hierarchical and auto there, as before for the others
    phases = [_commsched(name, 0.8) for name in ("planned", "hierarchical:1MiB/4MiB", "auto", "dynamic")]
    on_two = build_report({**CONFIG, "workers": 4, "nodes": 2}, "netns", "note", {"name": "tiny"},
                          _layered_baseline(), phases)
    assert [r["efficiency_combined"] is None for r in on_two["results"]] == [True, True, True, False]
    flat = build_report(CONFIG, "netns", "note", {"name": "tiny"},  # 2 workers on 2 nodes: one rank each
                        _layered_baseline(), phases)
    assert all(r["efficiency_combined"] is not None for r in flat["results"])


def test_a_dependency_that_adds_under_one_percent_is_not_named_in_the_table():
    # a 1-byte first layer (its all-reduce is nothing) and a second one ready 10 ms into backward:
    # the bound is compute and a hair, so the header says no layer adds 1 %
    r0 = _baseline_rank(0)
    r0["layers"] = [{"layer": "0:Conv", "param_bytes": 1, "forward_ms": 10.0, "grad_ready_ms": 100.0},
                    {"layer": "1:Linear", "param_bytes": 999, "forward_ms": 10.0, "grad_ready_ms": 10.0}]
    report = build_report(CONFIG, "netns", "note", {"name": "tiny"},
                          PhaseResult("baseline", "ok", [r0, _baseline_rank(1)]), [])
    assert report["baseline"]["dependency_bound_s"] == pytest.approx(0.65, rel=1e-3)
    assert "no layer's dependency adds 1 % to max(compute, comm) here" in markdown(report)


def _cpus():
    import os

    return os.cpu_count() or 1


def test_strategy_metrics_speedup_and_estimated_bubbles():
    ddp = PhaseResult("ddp", "ok", [
        _train_rank([1.0, 1.0, 1.2, 1.0], DDP, backward=[0.85] * 4),
        _train_rank([1.0, 1.0, 1.0, 1.0], DDP, backward=[0.85] * 4)])
    hvd = PhaseResult("horovod", "ok", [
        _train_rank([0.8] * 4, HVD, step_call=[0.25] * 4),
        _train_rank([0.8] * 4, HVD, step_call=[0.25] * 4, checksum="b")])
    own = PhaseResult("dynamic", "ok", [
        _train_rank([0.7] * 4, "commsched", bubbles=[0.1, 0.1, 0.2, 0.1]),
        _train_rank([0.7] * 4, "commsched", bubbles=[0.3] * 4)])
    report = _report([ddp, hvd, own])
    r_ddp, r_hvd, r_own = report["results"]
    assert r_ddp["step_time_s"] == pytest.approx(1.0)
    assert r_ddp["step_time_iqr_s"] == pytest.approx(quantile([1, 1, 1.2, 1], .75) - 1.0)
    assert r_ddp["bubble_s"] == pytest.approx(0.85 - 0.45)  # backward minus backward under comm
    assert r_hvd["bubble_s"] == pytest.approx(0.25 - 0.05)  # step() minus optimizer step
    assert r_own["bubble_s"] == pytest.approx(0.3)  # the slowest rank's median
    assert report["baseline_strategy"] == "ddp"
    assert r_hvd["speedup_vs_baseline"] == pytest.approx(1.0 / 0.8)
    # overlap = 1 - exposed / comm, exposed = the measured bubble (slowest rank 0.3 of comm 0.5)
    assert r_own["overlap_ratio"] == pytest.approx(1 - 0.3 / 0.5)
    assert r_own["exposed_comm_s"] == pytest.approx(0.3) and "bubble" in r_own["overlap_method"]
    assert r_ddp["overlap_ratio"] == pytest.approx(1 - 0.4 / 0.5)  # DDP's estimated bubble
    assert r_own["efficiency"] == pytest.approx(0.65 / 0.7)
    assert r_own["efficiency_contended"] == pytest.approx(0.75 / 0.7)
    assert "| 0.93 (1.07) |" in markdown(report)  # the contended efficiency in parentheses
    assert not any("beats the lower bound" in w for w in report["warnings"])
    assert r_own["throughput_samples_s"] == pytest.approx(16 / 0.7)
    assert r_ddp["params_consistent"] and not r_hvd["params_consistent"]
    assert any("horovod: ranks ended with different parameters" in w for w in report["warnings"])
    assert all(r["cpu_warning"] for r in report["results"])  # 0.95 > 0.9


def test_a_step_below_the_lower_bound_is_flagged():
    fast = PhaseResult("static", "ok", [_train_rank([0.5] * 4, "commsched", bubbles=[0.0] * 4),
                                        _train_rank([0.5] * 4, "commsched", bubbles=[0.0] * 4)])
    report = _report([fast])
    assert report["results"][0]["efficiency"] == pytest.approx(0.65 / 0.5)
    assert any("static: step 0.500 s beats the lower bound" in w for w in report["warnings"])


def test_skipped_and_failed_strategies_keep_their_row_and_reason():
    report = _report([PhaseResult("horovod", "skipped", reason="horovod is not installed"),
                      PhaseResult("dynamic", "failed", reason="workers failed:\nrank 0 ...")])
    skipped, failed = report["results"]
    assert skipped["status"] == "skipped" and skipped["step_time_s"] is None
    assert failed["reason"].startswith("workers failed")
    table = markdown(report)
    assert "| horovod | skipped: horovod is not installed |" in table
    assert "| dynamic | failed: workers failed: |" in table


def test_quantile_interpolates_and_ignores_missing():
    assert quantile([], 0.5) is None
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([1.0, 2.0], 0.25) == pytest.approx(1.25)


def test_comm_contention_reads_the_all_reduce_beside_compute_against_alone():
    # all of it beside compute (it ended first): 0.6 s against 0.4 s alone
    assert comm_contention([(1.0, 0.6)] * 3, 0.4) == pytest.approx(1.5)
    # it outlasted compute: 0.5 s beside compute at 1/lam, then 0.2 s alone -> 0.5/lam + 0.2 = 0.4
    assert comm_contention([(0.5, 0.7)] * 3, 0.4) == pytest.approx(2.5)
    # the median of the repetitions; a tail longer than the whole all-reduce alone is skipped
    assert comm_contention([(1.0, 0.6), (1.0, 0.8), (0.1, 0.9), (1.0, 0.4)], 0.4) == pytest.approx(1.5)
    # never below 1 (faster beside compute is noise); nothing to read without a time alone
    assert comm_contention([(1.0, 0.3)], 0.4) == 1.0
    assert comm_contention([(1.0, 0.3)], None) is None and comm_contention([(0.1, 0.9)], 0.4) is None
