"""The profiler: layers in forward order, tensors as the scheduler names them, times that add up.

Timing checks use layers that sleep a known time in forward and in backward, so they
test where each interval is attributed, not how fast this machine is. Run as a
script (``--out PATH``), this file is one gloo rank of the ``opt.profile()`` tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from commsched.bench.report import contention_from
from commsched.costmodel.profile import Profile, steal_share
from commsched.plugins.torch.profiler import (
    SCHED_CPU_STEPS,
    TWO_LEVEL_STEPS,
    _steal,
    format_profile,
    load_or_profile,
    profile_model,
)

FWD_SLEEP = 0.1
BWD_SLEEP = 0.08
#: A sleep overshoots by the scheduler's latency, never undershoots; on 2 cores shared with
#: other test runs a woken thread waited up to ~40 ms. Medians over 5 steps, and the
#: sleeps are longer than that, so misattributing one (or scaling by a wrong factor) fails.
SLACK = 0.045
#: opt.profile()'s runs slow commsched's gradient hook by this much a gradient: more than SLACK, so a
#: hook left in the sleepy layer's backward (or five of them in the step's overhead) fails.
HOOK_SLEEP = 0.05


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(BWD_SLEEP)
        return grad


class Sleepy(nn.Module):
    """Owns its weight; sleeps ``fwd`` in forward and ``bwd`` in backward before its weight's gradient."""

    def __init__(self, dim: int, fwd: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim ** 0.5)
        self.fwd = fwd

    def forward(self, x):
        time.sleep(self.fwd)
        return _SleepInBackward.apply(torch.tanh(x @ self.weight))


class Net(nn.Module):
    def __init__(self, fwd: float = FWD_SLEEP) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.sleepy = Sleepy(32, fwd)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.sleepy(torch.relu(self.stem(x))))


class Tied(nn.Module):
    """An embedding reused as the output projection: one parameter, two uses."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.mix = nn.Linear(16, 16)

    def forward(self, idx):
        return torch.tanh(self.mix(self.embed(idx))) @ self.embed.weight.t()


def _batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)


def _profile(model=None, steps=5):
    torch.manual_seed(0)
    model = model or Net()
    x, y = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, profile_model(model, x, y, nn.functional.cross_entropy, opt, steps=steps)


def test_layers_come_in_forward_order_with_the_models_parameters_as_tensors():
    model, prof = _profile()
    assert [layer.name for layer in prof.layers] == ["stem", "sleepy", "head"]
    params = dict(model.named_parameters())
    tensors = [(t.name, t.numel, t.element_size) for layer in prof.layers for t in layer.tensors]
    assert tensors == [(n, p.numel(), p.element_size()) for n, p in params.items()]
    assert prof.grad_bytes == sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_layer_that_sleeps_gets_its_sleep_in_forward_and_backward_and_no_other_layer_does():
    _, prof = _profile()
    stem, sleepy, head = prof.layers
    assert FWD_SLEEP - 0.002 <= sleepy.forward_s <= FWD_SLEEP + SLACK
    assert BWD_SLEEP - 0.002 <= sleepy.backward_s <= BWD_SLEEP + SLACK
    assert stem.forward_s + head.forward_s < SLACK and stem.backward_s + head.backward_s < SLACK
    # ready times run backwards through the layers: head first, the stem last
    ready = [layer.ready_s for layer in prof.layers]
    assert ready[2] <= ready[1] <= ready[0]
    assert ready[1] >= BWD_SLEEP - 0.002 and ready[2] < SLACK
    assert prof.ready_times() == pytest.approx(ready)


def test_the_totals_match_a_directly_timed_step():
    torch.manual_seed(0)
    model = Net()
    x, y = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    direct = []
    for _ in range(6):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        direct.append(time.perf_counter() - t0)
    direct_s = sorted(direct[1:])[2]
    prof = profile_model(model, x, y, nn.functional.cross_entropy, opt, steps=5)
    # as the bench's compute: forward + backward + the optimizer's own step of all parameters
    total = prof.forward_s + prof.backward_s + prof.step_overhead_s + prof.meta["optimizer_step_s"]
    assert total == pytest.approx(prof.meta["forward_s"] + prof.meta["backward_s"] + prof.meta["optimizer_step_s"])
    assert abs(total - direct_s) < SLACK
    assert total >= FWD_SLEEP + BWD_SLEEP
    assert all(layer.apply_s > 0 for layer in prof.layers)


def test_a_tied_weight_is_one_tensor_of_its_first_user_and_ready_last():
    torch.manual_seed(0)
    model = Tied()
    idx = torch.randint(0, 50, (4, 6))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = profile_model(model, idx, torch.randint(0, 50, (4, 6)),
                         lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()), opt, steps=2)
    assert [layer.name for layer in prof.layers] == ["embed", "mix"]
    assert [t.name for t in prof.layers[0].tensors] == ["embed.weight"]
    assert prof.layers[0].ready_s >= prof.layers[1].ready_s


def test_a_registered_tie_is_named_in_the_profile_and_an_inline_one_is_not():
    class Registered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.mix = nn.Linear(16, 16)
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight  # as GPT-2 ties: one parameter, two names

        def forward(self, idx):
            return self.head(torch.tanh(self.mix(self.embed(idx))))

    idx, y = torch.randint(0, 50, (4, 6)), torch.randint(0, 50, (4, 6))

    def loss(out, target):
        return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())

    profiles = []
    for model, tied in ((Registered(), ("embed.weight",)), (Tied(), ())):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        profiles.append(profile_model(model, idx, y, loss, opt, steps=2))
        assert profiles[-1].tied == tied
    # what the simulator's `+tied` strategies and `planned+tied` plans start from: the weight ready early
    registered = profiles[0]
    assert registered.layers[0].name == "embed"
    assert registered.with_tied_split().ready_times()[0] < registered.ready_times()[0]


def test_the_profile_survives_a_json_round_trip(tmp_path):
    _, prof = _profile(steps=2)
    path = tmp_path / "profile.json"
    prof.to_json(str(path))
    again = Profile.from_json(str(path))
    assert again.layers == prof.layers
    assert again.step_overhead_s == prof.step_overhead_s and again.contention == prof.contention


def test_contention_is_corrected_when_the_all_reduce_ends_before_the_compute():
    # compute 1 s alone, 1.5x slower under comm, all-reduce over after 0.6 s of wall time:
    # 0.4 s of work under it, 0.6 s alone after it -> 1.2 s, coverage 0.5
    kappa, how = contention_from({"compute_s": 1.0, "compute_under_comm_s": 1.2, "under_comm_coverage": 0.5})
    assert kappa == pytest.approx(1.5) and how["raw_ratio"] == pytest.approx(1.2)
    assert contention_from({"compute_s": 1.0, "compute_under_comm_s": 1.3, "under_comm_coverage": 1.0})[0] \
        == pytest.approx(1.3)


def test_the_steal_is_the_slowest_rank_s_scheduler_cpu_per_piece_times_the_machine_s_share(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    ranks = [{"sched_cpu": {"per_piece_s": 2e-4}}, {"sched_cpu": {"per_piece_s": 3e-4}}, {"sched_cpu": None},
             {"sched_cpu": {"per_piece_s": None}}]
    steal, how = _steal(ranks, 4)
    assert steal == pytest.approx(3e-4 * 2.0) and how["share"] == 2.0 and how["cores"] == 2
    assert _steal([{}], 2)[0] == 0.0  # nothing measured: no steal


def test_commsched_s_gradient_hooks_are_taken_out_of_the_backward_where_they_ran():
    from commsched.plugins.torch.profiler import _cut, _Pass

    def one(hooked: bool) -> _Pass:  # layer 1's gradient came at 0.5 s, layer 0's at 0.9 s
        return _Pass(start=0.0, layer_in={0: 0.0, 1: 0.1}, layer_out={0: 0.0, 1: 0.1}, forward_end=0.2,
                     backward_start=0.3, ready={1: 0.5, 0: 0.9}, end=1.0,
                     **({"hook": {1: 0.05, 0: 0.1}, "hooks": 3} if hooked else {}))
    plain = _cut([one(False)], 2)
    assert plain.backward == pytest.approx([0.4, 0.2]) and plain.hooks == 0 and plain.per_hook is None
    cut = _cut([one(True)], 2)
    # layer 1 ran 0.05 s of hooks before its stamp; layer 0 those and its own 0.1 s before its own
    assert cut.backward == pytest.approx([0.3, 0.15]) and cut.ready == pytest.approx([0.45, 0.15])
    assert cut.backward_total == pytest.approx(0.45)
    assert cut.hooks == pytest.approx(0.15) and cut.per_hook == pytest.approx(0.05)
    assert cut.per_grad is None and cut.per_task is None  # every hook submitted a task: no split
    # two of the three hooks only joined a fusion group (0.02 s each); the third submitted it (0.11 s)
    split = one(True)
    split.hook, split.task_hook_s, split.task_hooks = {1: 0.04, 0: 0.11}, 0.11, 1
    cut = _cut([split], 2)
    assert cut.per_grad == pytest.approx(0.02) and cut.per_task == pytest.approx(0.09)


def test_bad_flags_are_refused_naming_the_flag_before_anything_runs(capsys):
    from commsched.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--workload", "tiny", "--bandwidth", "nonsense", "--json", "x.json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--bandwidth" in err and "1gbit" in err
    assert main(["profile", "--workload", "tiny", "--workers", "3", "--nodes", "2", "--json", "x.json"]) == 2
    assert "--nodes 2 must divide --workers 3" in capsys.readouterr().err


def test_the_hook_splits_into_a_gradients_own_time_and_a_tasks_submit_where_both_kinds_ran():
    from commsched.plugins.torch.profiler import _grad_hook

    # rank 0: 10 hooks, 4 of them submitted a task: 6 x 1 ms joined a fusion group, 4 x 5 ms submitted
    both = {"sched_cpu": {"hook_s": 0.006 + 0.020, "hooks": 10, "task_hook_s": 0.020, "task_hooks": 4}}
    # rank 1: every hook submitted a task (no fused gradient): the mean per gradient, nothing per task
    alone = {"sched_cpu": {"hook_s": 0.008, "hooks": 4, "task_hook_s": 0.008, "task_hooks": 4}}
    out = _grad_hook([both])
    assert out["value"] == pytest.approx(0.001) and out["per_task_submit_s"] == pytest.approx(0.004)
    out = _grad_hook([alone])
    assert out["value"] == pytest.approx(0.002) and out["per_task_submit_s"] == 0.0
    # the rank with the most hook time (26 ms against 8) sets both; nothing measured: 0
    out = _grad_hook([alone, both, {"sched_cpu": None}])
    assert (out["value"], out["per_task_submit_s"]) == pytest.approx((0.001, 0.004))
    assert _grad_hook([{}]) == dict(_grad_hook([{}]), value=0.0, per_task_submit_s=0.0)


def test_a_workload_profile_adds_up_to_the_bench_baseline_and_is_cached(tmp_path):
    prof = load_or_profile("tiny", workers=2, network="loopback", steps=3, warmup=1, cache_dir=tmp_path,
                           log_stream=open(os.devnull, "w"))
    base = prof.meta["bench_baseline"]
    assert [layer.name for layer in prof.layers] == ["0.0", "1"]
    # scaled to the bench's multi-worker compute: forward, backward, optimizer.step() exactly
    total = prof.forward_s + prof.backward_s + prof.step_overhead_s + prof.meta["optimizer_step_s"]
    assert total == pytest.approx(base["compute_s"], rel=1e-9)
    assert prof.contention >= 1.0 and prof.meta["workers"] == 2
    # commsched's own threads, measured in a short dynamic run on every rank
    sched = prof.meta["scheduler_cpu"]
    assert [r["steps"] for r in sched["per_rank"]] == [SCHED_CPU_STEPS] * 2
    assert all(r["pieces"] > 0 and r["cpu_s"] > 0 for r in sched["per_rank"])
    assert sched["per_piece_cpu_s"] == max(r["per_piece_s"] for r in sched["per_rank"])
    assert prof.per_piece_steal_s == pytest.approx(sched["per_piece_cpu_s"] * steal_share(2, sched["cores"]))
    # the hand-off, from a short run with one piece in flight on every rank
    handoff = prof.meta["handoff"]
    assert len(handoff["per_rank_pieces"]) == 2 and min(handoff["per_rank_pieces"]) > 0
    assert prof.handoff_s == (handoff["value"] or 0.0) and prof.handoff_s >= 0.0
    assert (handoff["value"] is None) == (handoff["pairs"] == 0)
    # the gradient hook on the training thread, timed in the same dynamic run: every gradient, every step
    assert all(r["hooks"] == SCHED_CPU_STEPS * 4 and r["hook_s"] > 0 and 0 < r["task_hooks"] <= r["hooks"]
               for r in sched["per_rank"])
    hook = prof.meta["grad_hook"]
    slowest = max(hook["per_rank"], key=lambda row: row["hook_s"])
    assert [prof.per_grad_hook_s, prof.per_task_submit_s] == [slowest["per_grad_s"], slowest["per_task_s"]]
    assert prof.per_grad_hook_s > 0
    # the network's time per piece beyond the closed form, from the same run's last steps on both ranks
    link = prof.meta["link_excess"]
    assert link["steps"] and all(s["pieces"] > 0 and s["busy_s"] > 0 for s in link["steps"])
    assert prof.per_piece_link_s == (link["value"] or 0.0) >= 0.0
    # ... the slope over a second run with pieces a quarter the size, where it has a slope to fit
    fit = link["fit"]
    assert fit is not None and fit["small_partition_bytes"] == max(64 << 10, (1 << 20) // 4)
    assert link["measured"] == (fit["value"] if fit["value"] is not None else link["single_run"])
    assert link["charged"] == (2 > link["cores"]) and (link["charged"] or prof.per_piece_link_s == 0.0)
    cached = list(tmp_path.glob("tiny-*.json"))
    assert len(cached) == 1
    t0 = time.perf_counter()
    again = load_or_profile("tiny", workers=2, network="loopback", steps=3, cache_dir=tmp_path)
    assert time.perf_counter() - t0 < 1.0 and again.layers == prof.layers


def test_a_profile_on_two_nodes_measures_the_two_level_phases_and_how_late_the_last_rank_starts(tmp_path):
    prof = load_or_profile("tiny", workers=4, nodes=2, network="loopback", steps=3, warmup=1, cache_dir=tmp_path,
                           log_stream=open(os.devnull, "w"))
    # two short runs with every piece two-level (pieces of 1 MiB and 4 MiB): each phase priced from the
    # steps rank 0's groups recorded
    two = prof.meta["two_level"]
    assert two["partition_bytes"] == [1 << 20, 4 << 20]
    assert all(len(run[phase]) == TWO_LEVEL_STEPS and all(row["pieces"] > 0 and row["busy_s"] > 0 for row in run[phase])
               for run in two["runs"] for phase in ("reduce_scatter", "all_reduce", "all_gather"))
    assert set(two["value"]) == {"reduce_scatter", "all_reduce", "all_gather"}
    # the simulator gets the intra-node phases; the inter-node one stays in the meta
    assert prof.two_level_phases == {k: tuple(v) for k, v in two["value"].items() if k != "all_reduce"}
    assert all(m > 0 and c >= 0 for m, c in prof.two_level_phases.values())
    # the start skew, flat from the three short dynamic runs (3 steps each) and two-level from the two
    skew = prof.meta["start_skew"]
    assert [len(skew[a]["steps"]) for a in ("ring", "hierarchical")] == [9, 2 * TWO_LEVEL_STEPS]
    assert all(skew[a]["value"] >= 0 for a in ("ring", "hierarchical"))
    # the simulator charges two-level pieces the two-level skew; the flat one stays a diagnostic
    assert prof.two_level_skew_s == skew["hierarchical"]["value"]
    text = format_profile(prof)
    assert "two-level pieces, measured per phase" in text and "starts a step's communication" in text
    # one node: neither two-level runs nor a two-level skew
    flat = load_or_profile("tiny", workers=2, network="loopback", steps=3, warmup=1, cache_dir=tmp_path,
                           log_stream=open(os.devnull, "w"))
    assert flat.two_level_phases is None and flat.meta["two_level"] is None
    assert set(flat.meta["start_skew"]) == {"ring"} and flat.two_level_skew_s == 0.0


_STAMP_CHILD = """
import os, sys, time, torch, torch.distributed as dist
from commsched.plugins.torch.bench.worker import _Stamp
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
flat = torch.zeros(1 << 10)
landed = _Stamp()
t0 = time.perf_counter()
work = dist.all_reduce(flat, async_op=True)
work.get_future().add_done_callback(landed)
time.sleep(0.3)  # the step's compute, far longer than this all-reduce
work.wait()
print(landed.at(timeout=1.0) - t0, time.perf_counter() - t0)
dist.destroy_process_group()
"""


def test_the_baseline_stamps_an_all_reduce_that_ends_before_the_compute_at_its_own_end(tmp_path):
    # comm_contention compares the all-reduce beside compute with it alone: read by work.wait() after
    # the compute, an all-reduce that ended first looked as long as the compute (compute-heavy 2.2-6.2x).
    import subprocess

    out = subprocess.run([sys.executable, "-c", _STAMP_CHILD, str(tmp_path / "store")], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    stamped, observed = float(out[0]), float(out[1])
    assert observed >= 0.3 and stamped < 0.15


# ------------------------------------------------------------------ opt.profile() on 2 gloo ranks
@pytest.mark.parametrize("cross", [True, False], ids=["cross_iteration", "synchronous"])
def test_opt_profile_describes_the_last_steps_of_training(ranks, cross):
    results = ranks(2, "--cross", str(int(cross)), script=Path(__file__), timeout=120)
    for result in results:
        prof = Profile.from_dict(result["profile"])
        assert [layer.name for layer in prof.layers] == ["stem", "sleepy", "head"]
        assert [t.name for layer in prof.layers for t in layer.tensors] == result["names"]
        sleepy = prof.layers[1]
        assert 0.05 - 0.002 <= sleepy.forward_s <= 0.05 + SLACK
        assert BWD_SLEEP - 0.002 <= sleepy.backward_s <= BWD_SLEEP + SLACK
        ready = [layer.ready_s for layer in prof.layers]
        assert ready[2] <= ready[1] <= ready[0]
        assert all(layer.apply_s > 0 for layer in prof.layers)
        assert prof.meta["cross_iteration"] is cross and prof.meta["world_size"] == 2
        assert 3 <= prof.meta["measured_steps"] <= 8
        assert prof.meta["step_s"] >= 0.05 + BWD_SLEEP + 5 * HOOK_SLEEP and prof.step_overhead_s >= 0
        # the hook's own time is its own field, out of the layers' backward and out of the overhead
        assert HOOK_SLEEP - 0.002 <= prof.per_grad_hook_s <= HOOK_SLEEP + SLACK
        assert prof.meta["grad_hook"]["per_step_s"] >= 5 * (HOOK_SLEEP - 0.002)
        assert prof.step_overhead_s < 2 * HOOK_SLEEP
        # SGD with momentum on CPU is updated range by range cross-iteration; the synchronous path never is
        assert prof.ranged == (tuple(result["names"]) if cross else ())


def _rank_main() -> None:
    import torch.distributed as dist

    from commsched import SchedulerConfig
    from commsched.plugins.torch import DistributedOptimizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cross", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Net(fwd=0.05)
    x, y = _batch()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                               SchedulerConfig(cross_iteration=bool(args.cross)))
    submit = opt._submit

    def slow_hook(state):  # each parameter's gradient hook calls self._submit
        time.sleep(HOOK_SLEEP)
        submit(state)
    opt._submit = slow_hook
    with opt:
        for _ in range(10):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        model(x)  # the forward that applies the last update (cross-iteration) and closes the last step
        opt.synchronize()
        prof = opt.profile()
    names = [n for n, _ in model.named_parameters()]
    Path(args.out).write_text(json.dumps({"profile": prof.to_dict(), "names": names}))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(_rank_main())
