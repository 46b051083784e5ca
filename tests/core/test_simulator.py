"""The simulator against closed forms: no overlap = compute + comm, the physics bound,
earliest-due-date order on one link, DDP buckets, the scheduler's CPU taken from compute,
and the shape of its report."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commsched.costmodel.collectives import allreduce_s
from commsched.costmodel import profile as profile_module
from commsched.costmodel.profile import LayerProfile, Profile, TensorSpec, handoff_from_times, steal_share
from commsched.costmodel.simulator import SimSettings, parse_sim_strategy, simulate
from commsched.costmodel.topology import Link, Topology
from commsched.costmodel.zoo import zoo_profile

MB = 1 << 20


def flat(world: int = 2, bandwidth: float = 125e6, alpha: float = 0.0) -> Topology:
    link = Link(alpha_s=alpha, bandwidth=bandwidth)
    return Topology(nodes=world, ranks_per_node=1, intra=link, inter=link)


def profile_of(sizes_mb: list[float], fwd: float = 0.01, bwd: float = 0.02, apply: float = 0.001,
               contention: float = 1.0, comm_contention: float = 1.0) -> Profile:
    layers = tuple(LayerProfile(name=f"l{i}", forward_s=fwd, backward_s=bwd, apply_s=apply,
                                tensors=(TensorSpec(f"l{i}.w", int(mb * MB) // 4, 4),))
                   for i, mb in enumerate(sizes_mb))
    return Profile(layers=layers, contention=contention, per_piece_cpu_s=0.0, comm_contention=comm_contention)


def test_no_overlap_costs_compute_plus_one_flat_allreduce():
    prof, topo = profile_of([4, 4, 8]), flat()
    result = simulate(prof, topo, "allreduce")
    expected = prof.compute_s + allreduce_s(topo, prof.grad_bytes, "ring")
    assert result.step_time_s == pytest.approx(expected, rel=1e-9)
    assert result.exposed_comm_s == pytest.approx(allreduce_s(topo, prof.grad_bytes, "ring"), rel=1e-9)
    assert result.overlap_ratio == pytest.approx(0.0, abs=1e-9)


def test_communication_slowed_by_compute_changes_nothing_where_nothing_overlaps():
    prof, topo = profile_of([4, 4, 8], contention=1.3, comm_contention=1.7), flat()
    result = simulate(prof, topo, "allreduce")
    assert result.step_time_s == pytest.approx(prof.compute_s + allreduce_s(topo, prof.grad_bytes, "ring"), rel=1e-9)


@pytest.mark.parametrize("kappa,lam", [(1.0, 1.0), (1.2, 1.0), (1.0, 1.5), (1.2, 1.5), (1.4, 2.5)])
def test_a_collective_beside_compute_runs_comm_contention_times_slower_until_compute_stops(kappa, lam):
    # DDP, two layers: the last layer's 8 MiB bucket is reduced while layer 0's backward runs
    # (compute slowed by kappa, the collective by lam); then the step waits for what is left of
    # it at full speed, then layer 0's tiny bucket, then the optimizer step.
    fwd, bwd, apply = 0.01, 0.02, 0.001
    prof, topo = profile_of([0.01, 8], fwd, bwd, apply, contention=kappa, comm_contention=lam), flat()
    c1 = allreduce_s(topo, prof.layers[1].grad_bytes, "ring")
    c0 = allreduce_s(topo, prof.layers[0].grad_bytes, "ring")
    beside = bwd * kappa  # layer 0's backward, wall seconds, all of it beside the big bucket
    assert beside / lam < c1  # (the bucket outlasts it, as the closed form below assumes)
    expected = 2 * fwd + bwd + beside + (c1 - beside / lam) + c0 + 2 * apply
    result = simulate(prof, topo, "ddp", SimSettings(trace=True))
    assert result.step_time_s == pytest.approx(expected, rel=1e-9)
    # the trace and the busy time show the collective as long as it ran
    assert result.comm_busy_s == pytest.approx(beside + (c1 - beside / lam) + c0, rel=1e-9)
    big = [e for e in result.trace if e.get("name") == "bucket0" and e.get("tid") == 1]
    assert big and all(e["dur"] == pytest.approx((beside + c1 - beside / lam) * 1e6, rel=1e-9) for e in big)


def test_comm_contention_below_one_is_refused_by_name_and_round_trips_and_defaults_to_one():
    with pytest.raises(ValueError, match="comm_contention"):
        profile_of([1.0], comm_contention=0.9)
    data = profile_of([1.0], comm_contention=1.7).to_dict()
    assert Profile.from_dict(data).comm_contention == 1.7
    del data["comm_contention"]  # a profile written before the field existed
    assert Profile.from_dict(data).comm_contention == 1.0


def test_one_rank_has_nothing_to_communicate():
    prof = profile_of([4, 4])
    one = Topology(nodes=1, ranks_per_node=1, intra=Link(0.0, 1e9), inter=Link(0.0, 1e9))
    for name in ("ddp", "dynamic", "allreduce", "fifo"):
        assert simulate(prof, one, name).step_time_s == pytest.approx(prof.compute_s, rel=1e-9), name
    # Horovod's background thread still waits one cycle for the tensors of a step
    cycle = SimSettings().horovod_cycle_s
    assert simulate(prof, one, "horovod").step_time_s == pytest.approx(prof.compute_s + cycle, rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.floats(0.05, 20.0), min_size=1, max_size=6),
       fwd=st.floats(0.0, 0.05), bwd=st.floats(0.001, 0.1), bandwidth=st.floats(2e7, 2e9),
       contention=st.floats(1.0, 1.5), comm_contention=st.floats(1.0, 2.0),
       name=st.sampled_from(["ddp", "ddp:1", "horovod", "allreduce", "fifo", "dynamic", "static"]))
def test_no_strategy_beats_max_of_compute_and_comm_nor_loses_to_their_sum(sizes, fwd, bwd, bandwidth,
                                                                         contention, comm_contention, name):
    prof = profile_of(sizes, fwd, bwd, contention=contention, comm_contention=comm_contention)
    topo = flat(bandwidth=bandwidth, alpha=1e-4)
    result = simulate(prof, topo, name, SimSettings(partition_bytes=MB, credit_bytes=2 * MB))
    comm = result.comm_busy_s
    cycle = SimSettings().horovod_cycle_s if name == "horovod" else 0.0  # Horovod's background cycle
    assert result.step_time_s >= max(prof.compute_s, comm) * (1 - 1e-9)
    assert result.step_time_s <= (prof.compute_s * contention + comm + cycle) * (1 + 1e-9) + 1e-12
    assert 0.0 <= result.overlap_ratio <= 1.0


def _edd_reference(release: list[float], due: list[int], sizes: list[int], piece: int, bandwidth: float
                   ) -> list[str]:
    """Earliest-due-date on one link, preemptive at piece boundaries (written independently)."""
    jobs = []  # (release, due, piece index, name, seconds)
    for i, (r, d, nbytes) in enumerate(zip(release, due, sizes, strict=True)):
        for k in range(-(-nbytes // piece)):
            jobs.append((r, d, k, f"l{i}.w#{k}", min(piece, nbytes - k * piece) / bandwidth))
    t, order, pending = 0.0, [], list(jobs)
    while pending:
        ready = [j for j in pending if j[0] <= t + 1e-12]
        if not ready:
            t = min(j[0] for j in pending)
            continue
        job = min(ready, key=lambda j: (j[1], j[0], j[2]))  # most urgent due date, then release, then index
        pending.remove(job)
        order.append(job[3])
        t += job[4]
    return order


def test_priority_and_partition_on_one_link_is_earliest_due_date_order():
    # Backward makes the last layer ready first; the next forward needs layer 0 first.
    sizes_mb = [3, 1, 2, 4]
    bwd = 0.004
    prof = profile_of(sizes_mb, fwd=0.0, bwd=bwd)
    topo = flat(bandwidth=1e9)
    piece = MB // 4
    result = simulate(prof, topo, "dynamic", SimSettings(partition_bytes=piece, credit_bytes=piece, steps=3))
    ready = prof.ready_times()
    step1 = [e for e in result.trace if e.get("tid") == 1]
    # the first step's pieces: those issued before the second step's first piece
    names = [e["name"] for e in step1]
    first = names[: sum(-(-int(mb * MB) // piece) for mb in sizes_mb)]
    sizes = [int(mb * MB) for mb in sizes_mb]
    ring = allreduce_s(topo, piece, "ring") / piece  # seconds per byte of this link, per piece
    assert first == _edd_reference(ready, list(range(len(sizes))), sizes, piece, 1 / ring)


def test_ddp_sends_buckets_in_reverse_order_closing_each_once_it_holds_its_limit():
    # torch 2.13's rule (_compute_bucket_assignment_by_size, measured with a comm hook): a tensor
    # joins the open bucket, which closes once it holds at least its limit
    prof = profile_of([10, 10, 0.5, 0.25])  # the last layers are ready first
    result = simulate(prof, flat(), "ddp", SimSettings(ddp_bucket_bytes=25 * MB, ddp_first_bucket_bytes=MB))
    buckets = [e for e in result.trace if e.get("tid") == 1]
    sizes = [e["args"]["bytes"] for e in buckets[:2]]
    assert sizes == [int(10.75 * MB), 10 * MB]  # 0.25 + 0.5 + 10 reach the 1 MiB first limit; then 10 alone
    assert result.pieces_per_step == 2
    # ddp:<MB> (bucket_cap_mb given): every bucket's limit is the cap, no small first bucket
    capped = simulate(profile_of([1, 1, 1, 1, 1]), flat(), "ddp:2")
    sizes = [e["args"]["bytes"] for e in capped.trace if e.get("tid") == 1][:3]
    assert sizes == [2 * MB, 2 * MB, MB]


def test_ddp_buckets_match_torchs_own_assignment():
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    from commsched.costmodel.simulator import _ddp_buckets

    mbs = [0.3, 2.4, 0.01, 1.2, 0.004, 0.8, 3.0, 0.05]
    prof = profile_of(mbs)
    ready = [t for layer in reversed(prof.layers) for t in reversed(layer.tensors)]
    for first, cap in ((MB, 25 * MB), (MB, MB), (4 * MB, 4 * MB)):
        ours = [[t.name for _, t in b] for b in _ddp_buckets(prof, first, cap)]
        indices, _ = dist._compute_bucket_assignment_by_size([torch.empty(t.nbytes // 4) for t in ready],
                                                            [first, cap])
        assert ours == [[ready[i].name for i in b] for b in indices], (first, cap)


def test_cross_iteration_hides_communication_that_ddp_exposes_when_layer0_is_small():
    # comm-bound with a big last layer: DDP waits for everything before the next forward,
    # dynamic lets the next forward start as soon as layer 0 is back.
    prof = profile_of([0.5, 8, 8, 16], fwd=0.02, bwd=0.04)
    topo = flat(bandwidth=250e6)
    ddp, dyn = simulate(prof, topo, "ddp"), simulate(prof, topo, "dynamic")
    assert dyn.step_time_s < ddp.step_time_s
    assert dyn.exposed_comm_s < ddp.exposed_comm_s


def test_the_trace_is_chrome_json_with_compute_and_network_lanes():
    result = simulate(profile_of([2, 2]), flat(), "dynamic")
    doc = json.loads(result.trace_json())
    lanes = {e["tid"] for e in doc["traceEvents"]}
    assert lanes == {0, 1}
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    marks = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert spans and all(e["dur"] >= 0 for e in spans)
    assert [m["name"] for m in marks] == [f"step {s}" for s in range(5)] + ["end"]  # the step boundaries
    assert len(spans) + len(marks) == len(doc["traceEvents"])


@pytest.mark.parametrize("bad", ["ddp:0", "ddp:x", "dynamic:3", "nccl", ""])
def test_unknown_or_malformed_strategies_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="strategy|known"):
        parse_sim_strategy(bad)


def test_a_70b_decoder_on_128_ranks_is_bound_by_its_gradient_bytes():
    zoo = pytest.importorskip("commsched.costmodel.zoo")
    prof = zoo.zoo_profile("gpt-70b", "h100")
    topo = Topology.described("16x8", intra="900GB/s", inter="100gbit")
    result = simulate(prof, topo, "dynamic", SimSettings(steps=3, partition_bytes=64 * MB, credit_bytes=256 * MB))
    # a flat ring moves 2(n-1)/n of the gradient through every rank's slowest link: seconds, not ms
    floor = 2 * 127 / 128 * prof.grad_bytes / topo.inter.bandwidth
    assert result.step_time_s >= floor


@pytest.mark.parametrize("name", ["fifo", "dynamic", "static"])
@pytest.mark.parametrize("k", [2, 4, 6])
def test_each_piece_issued_between_two_layers_of_backward_costs_the_compute_lane_its_steal(name, k):
    # k layers, one piece each, a network so fast that no wait happens: layer i's piece is issued
    # as its backward ends, and the next layer's backward pays the scheduler's CPU. The last
    # (layer 0's) is issued when the lane waits for it to come back, on a free core: no cost.
    steal = 1e-3
    prof, topo = profile_of([0.5] * k), flat(bandwidth=1e12)
    base = simulate(prof, topo, name).step_time_s
    paid = simulate(dataclasses.replace(prof, per_piece_steal_s=steal), topo, name).step_time_s
    assert paid - base == pytest.approx((k - 1) * steal, rel=1e-9)


@pytest.mark.parametrize("name", ["ddp", "horovod", "allreduce"])
def test_the_scheduler_steal_is_commsched_s_own_and_costs_the_peers_nothing(name):
    prof, topo = profile_of([0.5, 2, 4]), flat()
    base = simulate(prof, topo, name).step_time_s
    assert simulate(dataclasses.replace(prof, per_piece_steal_s=1e-3), topo, name).step_time_s == base


def test_a_comm_bound_step_pays_no_steal_for_pieces_issued_while_compute_waits():
    # one layer: its pieces are issued when backward ended and the lane waits for them
    prof, topo = profile_of([8]), flat(bandwidth=125e6)
    settings = SimSettings(partition_bytes=MB, credit_bytes=2 * MB)
    base = simulate(prof, topo, "dynamic", settings).step_time_s
    assert simulate(dataclasses.replace(prof, per_piece_steal_s=1e-3), topo, "dynamic",
                    settings).step_time_s == pytest.approx(base, rel=1e-12)


@pytest.mark.parametrize("ranks,cores,share", [(2, 2, 1.0), (4, 2, 2.0), (1, 2, 0.0), (8, 16, 0.0), (3, 4, 0.5),
                                               (1, 1, 1.0)])
def test_steal_share_is_ranks_per_core_when_cores_are_full_and_none_with_two_cores_per_rank(ranks, cores, share):
    assert steal_share(ranks, cores) == pytest.approx(share)


def test_steal_is_checked_round_trips_and_defaults_to_zero():
    with pytest.raises(ValueError, match="per_piece_steal_s"):
        dataclasses.replace(profile_of([1.0]), per_piece_steal_s=-1e-6)
    with pytest.raises(ValueError, match="ranks >= 1"):
        steal_share(0, 2)
    data = dataclasses.replace(profile_of([1.0]), per_piece_steal_s=2.5e-4).to_dict()
    assert Profile.from_dict(data).per_piece_steal_s == 2.5e-4
    assert Profile.from_dict(data).scaled(compute=2.0).per_piece_steal_s == 2.5e-4
    del data["per_piece_steal_s"]  # a profile written before the field existed
    assert Profile.from_dict(data).per_piece_steal_s == 0.0


def test_one_piece_in_flight_pays_the_handoff_on_every_piece_that_waited_and_a_deeper_credit_none():
    # one 8 MiB layer after backward: 8 pieces of 1 MiB wait on an idle compute lane. With one in
    # flight each of the 7 that waited for the one before pays the hand-off on an idle link; with
    # four in flight the next is queued behind the one on the link, so none waits.
    h = 2e-3
    prof, topo = profile_of([8]), flat(bandwidth=125e6)
    one, four = SimSettings(partition_bytes=MB, credit_bytes=MB), SimSettings(partition_bytes=MB, credit_bytes=4 * MB)
    paid = dataclasses.replace(prof, handoff_s=h)
    base_one = simulate(prof, topo, "dynamic", one)
    with_one = simulate(paid, topo, "dynamic", one)
    assert base_one.handoffs_per_step == 0
    assert with_one.handoffs_per_step == 7
    assert with_one.step_time_s - base_one.step_time_s == pytest.approx(7 * h, rel=1e-6)
    with_four = simulate(paid, topo, "dynamic", four)
    assert with_four.handoffs_per_step == 0
    assert with_four.step_time_s == pytest.approx(simulate(prof, topo, "dynamic", four).step_time_s, rel=1e-12)
    assert with_four.step_time_s < with_one.step_time_s


@pytest.mark.parametrize("name", ["fifo", "ddp", "horovod", "allreduce"])
def test_the_handoff_costs_nothing_where_no_piece_waits_for_credit(name):
    prof, topo = profile_of([0.5, 2, 4]), flat()
    base = simulate(prof, topo, name).step_time_s
    assert simulate(dataclasses.replace(prof, handoff_s=5e-3), topo, name).step_time_s == base


def test_handoff_is_checked_round_trips_and_defaults_to_zero():
    with pytest.raises(ValueError, match="handoff_s"):
        dataclasses.replace(profile_of([1.0]), handoff_s=-1e-6)
    data = dataclasses.replace(profile_of([1.0]), handoff_s=1.5e-3).to_dict()
    assert Profile.from_dict(data).handoff_s == 1.5e-3
    assert Profile.from_dict(data).scaled(compute=2.0).handoff_s == 1.5e-3
    del data["handoff_s"]  # a profile written before the field existed
    assert Profile.from_dict(data).handoff_s == 0.0


def _stats(order, issued, ready, landed):
    return {"per_step": {7: {"order": order}},
            "issue_times": {7: {"issued_at": issued, "ready_at": ready, "landed_at": landed}}}


def test_handoff_from_times_measures_first_landing_to_last_issue_of_pieces_that_waited():
    # a, b, c in one step on both ranks. b was ready on both before a landed: its gap counts,
    # from the earlier landing (10.0) to the later issue (10.004). c was ready on rank 1 only
    # after b landed (it waited for its data): not a hand-off.
    lead = _stats(["a", "b", "c"], [9.0, 10.002, 20.5], [8.0, 8.0, 12.0], [10.0, 20.0, 30.0])
    follower = _stats(["a", "b", "c"], [9.1, 10.004, 20.6], [8.0, 8.5, 20.1], [10.001, 20.002, 30.0])
    out = handoff_from_times([lead, follower])
    assert out["pairs"] == 1
    assert out["value"] == pytest.approx(0.004)
    # the same stats through JSON (string step keys) on one rank only: the same pieces are found
    assert handoff_from_times([json.loads(json.dumps(lead)), follower])["value"] == pytest.approx(0.004)
    # pieces are found by name when a rank started them in another order; one that never landed is skipped
    swapped = _stats(["b", "a", "c"], [10.004, 9.1, 20.6], [8.5, 8.0, 20.1], [20.002, None, 30.0])
    assert handoff_from_times([lead, swapped])["pairs"] == 0
    assert handoff_from_times([_stats([], [], [], [])])["value"] is None


def _link_stats(order, issued, landed, nbytes):
    out = _stats(order, issued, issued, landed)
    out["per_step"][7].update(pieces=len(order), bytes=nbytes)
    return out


def test_link_excess_from_times_is_the_union_of_the_collectives_spans_beyond_the_closed_form():
    link_excess = profile_module.link_excess_from_times
    # a runs from the follower's issue (0.5) to the lead's landing (2.0), b from 0.7 to 3.0: the
    # network had a piece from 0.5 to 3.0, 2.5 s. The closed form: 2 pieces x 1.0 s (1000 B each).
    lead = _link_stats(["a", "b"], [0.0, 0.6], [2.0, 3.0], 2000)
    follower = _link_stats(["b", "a"], [0.7, 0.5], [3.2, 2.1], 2000)  # found by name, in its own order
    cost = lambda nbytes: nbytes / 1000  # noqa: E731
    out = link_excess([lead, follower], cost)
    assert out["value"] == pytest.approx(0.25) and out["steps"][0]["busy_s"] == pytest.approx(2.5)
    # what the simulator slows by comm_contention is not counted again; never below 0
    assert link_excess([lead, follower], cost, 1.1)["value"] == pytest.approx((2.5 - 2.2) / 2)
    assert link_excess([lead, follower], cost, 1.5)["value"] == 0.0
    # through JSON (string step keys); a piece that never landed is left out of both sides
    unlanded = _link_stats(["a", "b"], [0.5, 0.7], [2.1, None], 2000)
    assert link_excess([json.loads(json.dumps(lead)), unlanded], cost)["value"] == pytest.approx(
        (2.0 - 0.5) - 1.0)
    assert link_excess([_stats([], [], [], [])], cost)["value"] is None
    with pytest.raises(ValueError, match="comm_contention"):
        link_excess([lead], cost, 0.5)


def _run(pieces, model_s, busy_s):
    return {"steps": [{"step": float(i), "pieces": float(pieces), "busy_s": b, "model_s": model_s,
                       "excess_per_piece_s": (b - model_s) / pieces} for i, b in enumerate(busy_s)]}


def test_piece_cost_fit_is_the_slope_per_piece_apart_from_what_stretches_the_bytes():
    fit = profile_module.piece_cost_fit
    # the same 1.0 s of closed form cut into 77 and into 280 pieces (a closed form of more pieces is
    # longer: each pays alpha); busy = 1.2 x closed + 3 ms x pieces, the median step of three
    big = _run(77, 1.0, [1.2 + 0.231 - 0.05, 1.2 + 0.231, 1.2 + 0.231 + 0.3])
    small = _run(280, 1.1, [1.32 + 0.84, 1.32 + 0.84 + 0.01, 1.32 + 0.84 - 0.2])
    out = fit([big, small])
    assert out["value"] == pytest.approx(0.003) and out["contention"] == pytest.approx(1.2)
    assert [r["pieces"] for r in out["runs"]] == [77, 280]
    # the order of the runs does not matter; a negative slope is floored at 0 (and kept as fitted)
    assert fit([small, big])["value"] == pytest.approx(0.003)
    fewer_cost_more = fit([_run(77, 1.0, [2.0]), _run(280, 1.1, [1.9])])
    assert fewer_cost_more["value"] == 0.0 and fewer_cost_more["fitted_s"] < 0
    # a stretch at 0 or below (the busy time doubled with the pieces, the closed forms barely moved: 4 ranks
    # on 2 cores, compute-heavy, measured): the slope took all of it, so there is none to trust (kept as fitted)
    all_slope = fit([_run(20, 0.1108, [0.2199]), _run(40, 0.1258, [0.4454])])
    assert all_slope["value"] is None and all_slope["contention"] < 0 and all_slope["fitted_s"] > 0.01
    # no slope: as many pieces in both runs, or a run without a step
    assert fit([_run(16, 1.0, [1.2]), _run(16, 1.0, [1.3])])["value"] is None
    assert fit([big, {"steps": []}])["value"] is None
    with pytest.raises(ValueError, match="two runs"):
        fit([big])


def test_the_link_excess_holds_the_network_for_every_commsched_piece_and_no_ddp_bucket():
    prof, topo = profile_of([8, 8]), flat()  # comm-bound: 16 pieces of 1 MiB under dynamic
    slow = dataclasses.replace(prof, per_piece_link_s=0.01)
    ddp = [simulate(p, topo, "ddp").step_time_s for p in (prof, slow)]
    assert ddp[0] == ddp[1]
    before, after = (simulate(p, topo, "dynamic").step_time_s for p in (prof, slow))
    assert after - before == pytest.approx(16 * 0.01, rel=0.05)
    data = slow.to_dict()
    assert Profile.from_dict(data).scaled(compute=2.0).per_piece_link_s == 0.01
    del data["per_piece_link_s"]  # a profile written before the field existed
    assert Profile.from_dict(data).per_piece_link_s == 0.0


def test_sync_is_fifo_whose_step_waits_for_every_piece_and_then_runs_the_optimizer_once():
    # comm-bound, two layers of 8 MiB: sync's step ends when the last piece lands, then the optimizer
    prof, topo = profile_of([8, 8]), flat()
    fifo, sync = simulate(prof, topo, "fifo"), simulate(prof, topo, "sync")
    assert parse_sim_strategy("sync").cross_iteration is False and parse_sim_strategy("fifo").cross_iteration
    both = 2 * allreduce_s(topo, 8 * MB, "ring")
    # layer 1's gradient is ready after its own backward (0.02 s); both reductions then run back to back
    assert sync.step_time_s == pytest.approx(0.02 + both + prof.step_optimizer_s + 2 * 0.01, rel=1e-6)
    assert fifo.pieces_per_step == sync.pieces_per_step == 2
    # commsched's hook runs in Python on either path (DDP's is its own, in C++)
    hooked = dataclasses.replace(prof, per_grad_hook_s=0.005)
    # (layer 1's hook delays the reductions' start; layer 0's runs while they do)
    assert simulate(hooked, topo, "sync").step_time_s == pytest.approx(sync.step_time_s + 0.005, rel=1e-6)
    assert simulate(hooked, topo, "ddp").step_time_s == simulate(prof, topo, "ddp").step_time_s
    # DDP's shape: one fused collective a step where the tensors are under the threshold
    assert simulate(profile_of([1, 1, 1]), topo, "sync+fuse=25MiB").pieces_per_step == 1


def test_a_task_s_submit_is_charged_once_per_task_in_the_hook_that_completes_it():
    # three 1 MiB gradients: alone, three tasks (three submits); fused into one run (25 MiB), one
    # submit, in the hook of layer 0, the last ready; comm-bound, so each submit on the way delays it
    prof, topo = profile_of([1, 1, 1]), flat()
    slow = dataclasses.replace(prof, per_task_submit_s=0.01)
    for strategy, submits in (("sync", 3), ("sync+fuse=25MiB", 1)):
        before, after = simulate(prof, topo, strategy), simulate(slow, topo, strategy)
        assert after.pieces_per_step == before.pieces_per_step == submits
        if submits == 1:
            assert after.step_time_s - before.step_time_s == pytest.approx(0.01, rel=1e-6)
        else:
            assert after.step_time_s - before.step_time_s >= 0.01 * 2 - 1e-9
    assert simulate(slow, topo, "ddp").step_time_s == simulate(prof, topo, "ddp").step_time_s
    data = slow.to_dict()
    assert Profile.from_dict(data).scaled(compute=2.0).per_task_submit_s == 0.01
    del data["per_task_submit_s"]  # a profile written before the field existed
    assert Profile.from_dict(data).per_task_submit_s == 0.0


def test_a_two_level_piece_pays_the_link_excess_on_its_inter_node_phase_the_pipelines_bottleneck():
    # 2 nodes x 2 ranks, a slow inter-node link and a fast intra one: the inter-node all-reduce
    # is the three-phase pipeline's bottleneck, so the excess held there delays every piece
    # (on the intra-node reduce-scatter it would hide behind the inter-node phase)
    topo = Topology(nodes=2, ranks_per_node=2, intra=Link(0.0, 10e9), inter=Link(0.0, 125e6))
    prof = profile_of([8, 8])
    slow = dataclasses.replace(prof, per_piece_link_s=0.01)
    before, after = (simulate(p, topo, "hierarchical").step_time_s for p in (prof, slow))
    assert after - before == pytest.approx(16 * 0.01, rel=0.1)
    # the scheduler's CPU a piece is paid as the piece enters the pipeline, hidden the same way
    busy = dataclasses.replace(prof, per_piece_cpu_s=0.001)
    assert simulate(busy, topo, "hierarchical").step_time_s - before < 16 * 0.001 / 2


def _two_level_ranks(pieces, busy, late=None):
    """Every rank's record of one run on 2 nodes x 2 ranks (rank = node * 2 + local): one step (10) of
    ``pieces`` pieces of 1 MiB, each phase's pieces back to back, piece i's phase lasting
    ``busy[phase] / pieces`` from the same issue on every rank, except ``late``: {rank: seconds} that
    rank issues every piece of every phase later (and lands with the others)."""
    late = late or {}
    names = [f"w#{i}" for i in range(pieces)]
    ranks = []
    for rank in range(4):
        phases = {}
        for k, phase in enumerate(profile_module.TWO_LEVEL_PHASES):
            each, t0 = busy[phase] / pieces, 100.0 * k
            phases[phase] = [[n, 10, t0 + i * each, t0 + i * each + min(late.get(rank, 0.0), each),
                              t0 + (i + 1) * each] for i, n in enumerate(names)]
        ranks.append({"phases": phases, "per_step": {"10": {"pieces": pieces, "bytes": pieces * MB,
                                                           "order": names}}})
    return ranks


def test_two_level_phases_are_fitted_per_phase_on_the_links_each_phase_holds():
    steps, fit = profile_module.two_level_phase_steps, profile_module.two_level_phase_fit
    closed = {"reduce_scatter": 0.001, "all_reduce": 0.010, "all_gather": 0.002}  # per MiB

    def cost(phase, nbytes):
        return closed[phase] * nbytes / MB
    # the phases as measured: 1.2 x closed + 20 ms a piece (intra), 1.25 x + 1 ms (inter), 1.0 x + 30 ms
    truth = {"reduce_scatter": (1.2, 0.020), "all_reduce": (1.25, 0.001), "all_gather": (1.0, 0.030)}

    def busy(pieces, piece_mb):
        return {ph: pieces * (m * closed[ph] * piece_mb + c) for ph, (m, c) in truth.items()}
    runs = [steps(_two_level_ranks(72, busy(72, 1.0)), 2, cost),
            steps(_two_level_ranks(18, busy(18, 4.0)), 2, lambda ph, nb: cost(ph, nb) * 4)]
    out = fit(runs)
    for phase, (m, c) in truth.items():
        assert out["value"][phase] == pytest.approx((m, c), rel=1e-6)
    # a late issue shortens a phase's busy time only where no other group kept its link busy: the
    # intra-node phases are node 0's (rank 1 is its other rank; node 1's rank 3 is not counted), the
    # inter-node all-reduce runs as two groups (local ranks 0 and 1) sharing the network, so it is
    # idle only while both wait (ranks 2 and 3 late, not rank 2 or 3 alone)
    base = busy(72, 1.0)
    for late, stretched in (((3,), set()), ((2,), set()), ((1,), {"reduce_scatter", "all_gather"}),
                            ((2, 3), {"all_reduce"})):
        rows = steps(_two_level_ranks(72, base, late=dict.fromkeys(late, 1e-4)), 2, cost)
        for phase in profile_module.TWO_LEVEL_PHASES:
            shorter = rows[phase][0]["busy_s"] < base[phase] - 72 * 0.5e-4
            assert shorter == (phase in stretched), (late, phase)
    # no slope (as many pieces in both runs): each phase priced by busy / closed form pooled
    same = fit([runs[0], runs[0]])
    assert same["value"]["all_reduce"][1] == 0.0
    assert same["value"]["all_reduce"][0] == pytest.approx(base["all_reduce"] / (72 * 0.010))
    assert fit([runs[0], {ph: [] for ph in runs[0]}])["value"] is None
    with pytest.raises(ValueError, match="every rank"):
        steps(_two_level_ranks(4, base)[:3], 2, cost)


def test_measured_two_level_phases_replace_the_closed_form_and_are_not_slowed_again_beside_compute():
    topo = Topology(nodes=2, ranks_per_node=2, intra=Link(0.0, 10e9), inter=Link(0.0, 125e6))
    prof = profile_of([8, 8], comm_contention=1.5)
    # comm-bound: 16 pieces of 1 MiB; the inter phase (the bottleneck) measured 1.1 x + 5 ms a piece
    ar = allreduce_s(Topology(nodes=2, ranks_per_node=1, intra=topo.intra, inter=topo.inter), MB, "ring")
    measured = dataclasses.replace(prof, per_piece_link_s=0.05,
                                   two_level_phases={"all_reduce": (1.1, 0.005), "all_gather": (1.0, 0.0)})
    result = simulate(measured, topo, "hierarchical", SimSettings(steps=3))
    spans = [e for e in json.loads(result.trace_json())["traceEvents"]
             if e.get("ph") == "X" and "inter all-reduce" in e["name"]]
    assert spans and all(e["dur"] == pytest.approx((1.1 * ar + 0.005) * 1e6, rel=1e-6) for e in spans)
    # the per-piece link excess and comm_contention are not charged on a measured phase, so the step
    # is shorter than with the closed form plus that excess
    assert result.step_time_s < simulate(dataclasses.replace(prof, per_piece_link_s=0.05), topo,
                                         "hierarchical").step_time_s
    again = Profile.from_dict(json.loads(json.dumps(measured.to_dict())))
    assert again.two_level_phases == {"all_reduce": (1.1, 0.005), "all_gather": (1.0, 0.0)}
    assert again.scaled(compute=2.0).two_level_phases == again.two_level_phases
    data = measured.to_dict()
    del data["two_level_phases"]  # a profile written before the field existed
    assert Profile.from_dict(data).two_level_phases is None
    with pytest.raises(ValueError, match="unknown phase 'inter'"):
        dataclasses.replace(prof, two_level_phases={"inter": (1.0, 0.0)})
    with pytest.raises(ValueError, match="stretch=0.0 must be > 0"):
        dataclasses.replace(prof, two_level_phases={"all_reduce": (0.0, 0.0)})


def test_the_start_skew_is_how_late_the_last_rank_issues_each_steps_first_piece():
    def rank(issued):  # two steps of pieces a, b; issued: {step: (a's issue, b's issue)}
        return {"per_step": {str(st): {"pieces": 2, "bytes": 2 * MB, "order": ["a", "b"]} for st in issued},
                "issue_times": {str(st): {"issued_at": list(t), "landed_at": [9.0, 9.0]} for st, t in issued.items()}}
    # step 3: rank 1 issues the first piece (a) 0.2 s after rank 0; step 4: b comes first, rank 2 0.01 s late
    ranks = [rank({3: (1.0, 1.1), 4: (5.25, 5.2)}), rank({3: (1.2, 1.25), 4: (5.3, 5.2)}),
             rank({3: (1.05, 1.3), 4: (5.21, 5.21)})]
    out = profile_module.start_skew_from_times(ranks)
    assert [(s["piece"], s["last_rank"]) for s in out["steps"]] == [("a", 1), ("b", 2)]
    assert [s["skew_s"] for s in out["steps"]] == pytest.approx([0.2, 0.01])
    assert out["value"] == pytest.approx(0.105) and out["median"] == pytest.approx(0.105)
    # several runs pool their steps
    pooled = profile_module.pooled_start_skew([ranks, [ranks[0], rank({3: (1.0, 1.4), 4: (5.25, 5.2)}), ranks[2]]])
    assert [s["skew_s"] for s in pooled["steps"]] == pytest.approx([0.2, 0.01, 0.05, 0.01])
    assert pooled["value"] == pytest.approx(0.0675) and pooled["median"] == pytest.approx(0.03)
    # a step some rank did not record is left out; none at all: no value
    assert len(profile_module.start_skew_from_times([ranks[0], rank({3: (1.0, 1.0)})])["steps"]) == 1
    assert profile_module.start_skew_from_times([ranks[0], rank({7: (1.0, 1.0)})])["value"] is None


def test_ranged_apply_leaves_only_the_last_pieces_share_of_a_waited_update_on_the_lane():
    # Comm-bound (16 MiB at 125 MB/s against 60 ms of compute): the next forward waits for both
    # layers, whose 8 MiB gradients come in 8 pieces of 1 MiB. Whole, each update (10 ms) runs
    # after the last piece; ranged, the forward does 7/8 of it while it waits (at most).
    prof, topo = profile_of([8, 8], apply=0.01), flat()
    ranged = simulate(prof, topo, "dynamic", SimSettings(ranged_apply=True)).step_time_s
    whole = simulate(prof, topo, "dynamic", SimSettings(ranged_apply=False)).step_time_s
    assert 0.001 < whole - ranged <= 2 * 0.01 * 7 / 8 + 1e-9
    # One piece per gradient (fifo), or a forward that never waits (compute-bound): nothing to range.
    for name, p in (("fifo", prof), ("dynamic", profile_of([0.5, 0.5], fwd=0.05, bwd=0.1, apply=0.01))):
        assert simulate(p, topo, name, SimSettings(ranged_apply=True)).step_time_s == pytest.approx(
            simulate(p, topo, name, SimSettings(ranged_apply=False)).step_time_s, rel=1e-12)
    # The profile says which tensors the training may range (PyTorch: a lean class on CPU): a profile
    # that names none is simulated whole, one that names a layer's gradient gains that layer's part only.
    names = prof.tensor_names()

    def step(ranged_names):
        return simulate(dataclasses.replace(prof, ranged=ranged_names), topo, "dynamic").step_time_s
    assert step(()) == pytest.approx(whole, rel=1e-12)
    assert step(tuple(names)) == pytest.approx(ranged, rel=1e-12)
    one = step(names[:1])
    assert ranged < one < whole
    with pytest.raises(ValueError, match=r"ranged=\['nope'\] names no tensor"):
        dataclasses.replace(prof, ranged=("nope",))


def test_commsched_s_gradient_hooks_stretch_its_backward_and_not_ddp_s():
    # Compute-bound (0.5 MB a layer at 125 MB/s beside 30 ms of compute a layer): the step is the lane's.
    # commsched's hook runs in Python on the training thread, 1 ms per gradient: 4 layers x 1 tensor
    # make the backward 4 ms longer. DDP's hooks are C++ inside the measured backward: unchanged.
    prof, topo = profile_of([0.5] * 4, fwd=0.01, bwd=0.02), flat()
    hooked = dataclasses.replace(prof, per_grad_hook_s=0.001)
    for name in ("fifo", "dynamic"):
        before, after = (simulate(p, topo, name).step_time_s for p in (prof, hooked))
        assert after - before == pytest.approx(0.004, abs=1e-9)
    assert simulate(hooked, topo, "ddp").step_time_s == simulate(prof, topo, "ddp").step_time_s
    assert Profile.from_dict(json.loads(json.dumps(hooked.to_dict()))).per_grad_hook_s == 0.001
    with pytest.raises(ValueError, match="per_grad_hook_s"):
        dataclasses.replace(prof, per_grad_hook_s=-1.0)


def test_the_zoo_ranges_updates_on_cpu_only_as_the_runtime_does():
    # The runtime's ranged apply is CPU-only (on CUDA the division runs on the stream, after the last piece).
    assert zoo_profile("resnet50", "h100").ranged == ()
    assert zoo_profile("resnet50", "cpu", dtype="fp32").ranged is None


def test_a_two_level_piece_waits_for_the_ranks_start_skew_holding_its_credit():
    topo = Topology(nodes=2, ranks_per_node=2, intra=Link(0.0, 10e9), inter=Link(0.0, 125e6))
    prof = profile_of([4] * 8)
    skew = 0.05
    late = dataclasses.replace(prof, two_level_skew_s=skew)

    def step(p, strategy, credit_mb):
        return simulate(p, topo, strategy, SimSettings(steps=4, credit_bytes=int(credit_mb * MB))).step_time_s
    # flat pieces and the peers do not wait for it
    for strategy in ("dynamic", "fifo", "ddp", "horovod"):
        assert step(late, strategy, 4) == step(prof, strategy, 4), strategy
    # a credit of one piece: every piece decided as its gradient is ready waits the skew with the link
    # idle behind it; a credit deep enough to hold the step's pieces pays it about once a step (the
    # first layer's pieces, ready last, wait it before the next forward can start)
    shallow = step(late, "hierarchical", 1) - step(prof, "hierarchical", 1)
    deep = step(late, "hierarchical", 64) - step(prof, "hierarchical", 64)
    assert 0 < deep <= skew * 1.001
    assert shallow > 2 * skew and shallow > 2 * deep
    # the profile keeps it; one written before the field existed has none; a negative one is refused
    again = Profile.from_dict(json.loads(json.dumps(late.to_dict())))
    assert again.two_level_skew_s == skew and again.scaled(compute=2.0).two_level_skew_s == skew
    data = late.to_dict()
    del data["two_level_skew_s"]
    assert Profile.from_dict(data).two_level_skew_s == 0.0
    with pytest.raises(ValueError, match="two_level_skew_s=-0.1 must be a finite number of seconds"):
        dataclasses.replace(prof, two_level_skew_s=-0.1)
