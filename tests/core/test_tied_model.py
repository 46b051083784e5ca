"""The tied-embedding split in the cost model: ``Profile.with_tied_split``, ``<strategy>+tied`` in the
simulator, ``planned+tied`` plans, ``commsched plan --split-tied`` and ``advise``."""

from __future__ import annotations

import json

import pytest

from commsched.cli import main
from commsched.costmodel.cli import _plan_for, advise
from commsched.costmodel.planner import PlanSearch, make_plan
from commsched.costmodel.profile import LayerProfile, Profile, TensorSpec
from commsched.costmodel.simulator import SimSettings, parse_sim_strategy, planned_tensors, simulate
from commsched.costmodel.topology import Link, Topology

MB = 1 << 20
QUICK = PlanSearch(partitions=(1 * MB, 4 * MB), credits=(4 * MB,), fusions=(0,), time_limit_s=1.0,
                   size_rounds=1, size_groups=2)


def flat(bandwidth: float = 125e6) -> Topology:
    link = Link(alpha_s=0.0, bandwidth=bandwidth)
    return Topology(nodes=2, ranks_per_node=1, intra=link, inter=link)


def lm(shared_layer: bool = False) -> Profile:
    """A GPT-like step: an 8 MiB tied embedding first in forward (with a small position table in its
    layer when ``shared_layer``), four 1 MiB blocks, a head with a norm."""
    first = [TensorSpec("wte.weight", 2 * MB)]  # 8 MiB of float32
    if shared_layer:
        first.append(TensorSpec("wpe.weight", 16_384))
    layers = [LayerProfile("embed", 0.002, 0.004, tuple(first), apply_s=0.004)]
    layers += [LayerProfile(f"block{i}", 0.01, 0.02, (TensorSpec(f"block{i}.w", MB // 4),), apply_s=0.001)
               for i in range(4)]
    layers.append(LayerProfile("head", 0.01, 0.03, (TensorSpec("head.ln", 512),), apply_s=0.0001))
    return Profile(layers=tuple(layers), per_piece_cpu_s=0.0, tied=("wte.weight",))


def test_the_split_makes_the_tied_weight_ready_with_the_head_and_changes_nothing_else():
    prof = lm()
    split = prof.with_tied_split()
    before, after = prof.ready_times(), split.ready_times()
    assert before[0] == pytest.approx(prof.backward_s)  # without the split: ready when backward ends
    assert after[0] == pytest.approx(prof.layers[-1].backward_s)  # with it: when the head's backward ends
    assert after[1:] == pytest.approx(before[1:])
    assert [t.name for t in planned_tensors(split)] == [t.name for t in planned_tensors(prof)]
    assert split.compute_s == pytest.approx(prof.compute_s) and split.grad_bytes == prof.grad_bytes
    assert split.tied == prof.tied and split.meta["tied_split"] == ["wte.weight"]
    assert split.with_tied_split() is split  # split already (a profile measured with the split keeps its times)
    # the split weight is reduced in two parts and applied whole: no longer among the ranged tensors
    assert "wte.weight" not in split.ranged and set(split.ranged) == set(prof.tensor_names()) - {"wte.weight"}


def test_a_tied_weight_that_shares_its_layer_moves_to_a_layer_of_its_own_before_it():
    prof = lm(shared_layer=True)
    split = prof.with_tied_split()
    assert [layer.name for layer in split.layers][:2] == ["embed[tied]", "embed"]
    tied, rest = split.layers[0], split.layers[1]
    assert [t.name for t in tied.tensors] == ["wte.weight"] and [t.name for t in rest.tensors] == ["wpe.weight"]
    ready = split.ready_times()
    assert ready[0] == pytest.approx(prof.layers[-1].backward_s)
    assert ready[1] == pytest.approx(prof.backward_s)  # the position table is still ready last
    share = tied.grad_bytes / prof.layers[0].grad_bytes
    assert tied.apply_s == pytest.approx(0.004 * share) and rest.apply_s == pytest.approx(0.004 * (1 - share))
    assert (tied.forward_s, tied.backward_s) == (0.0, 0.0) and rest.forward_s == prof.layers[0].forward_s
    assert split.compute_s == pytest.approx(prof.compute_s)


def test_dynamic_with_the_split_sends_the_tied_weight_first_and_is_faster():
    prof, topo = lm(), flat()
    plain = simulate(prof, topo, "dynamic")
    split = simulate(prof, topo, "dynamic+tied")
    assert plain.issue_order[-1].startswith("wte.weight") and not plain.issue_order[0].startswith("wte.weight")
    # ready with the head's norm (the last layer), so before every block: sent before any of them
    first_block = min(i for i, piece in enumerate(split.issue_order) if piece.startswith("block"))
    assert all(piece.startswith(("wte.weight", "head")) for piece in split.issue_order[:first_block])
    assert any(piece.startswith("wte.weight") for piece in split.issue_order[:first_block])
    assert split.step_time_s < plain.step_time_s * 0.95
    assert parse_sim_strategy("static+tied").split_tied and not parse_sim_strategy("static").split_tied


def test_a_plan_for_the_split_profile_is_faster_than_one_for_the_plain_step_and_fits_the_same_model():
    prof, topo = lm(), flat()
    plain = make_plan(prof, topo, QUICK).plan
    split = make_plan(prof.with_tied_split(), topo, QUICK).plan
    assert split.fingerprint == plain.fingerprint  # the same model: a split plan runs where a plain one does
    plain_s = simulate(prof, topo, "planned", plan=plain).step_time_s
    split_s = simulate(prof, topo, "planned+tied", plan=split).step_time_s
    assert split_s < plain_s * 0.95
    plans = _plan_for(["planned", "planned+tied", "dynamic"], prof, topo, time_limit_s=1.0)
    assert set(plans) == {"planned", "planned+tied"} and plans["planned"] is not plans["planned+tied"]


@pytest.mark.parametrize("call,needle", [
    (lambda: parse_sim_strategy("ddp+tied"), "modifiers are +tied"),
    (lambda: parse_sim_strategy("dynamic+fast"), "modifiers are +tied"),
    (lambda: simulate(Profile(layers=lm().layers), flat(), "dynamic+tied"), "drop +tied"),
    (lambda: lm().with_tied_split(["nope"]), "nope"),
    (lambda: Profile(layers=lm().layers, tied=("nope",)), "nope"),
    (lambda: Profile(layers=lm().layers).with_tied_split(), "Profile.tied is empty"),
])
def test_a_split_that_cannot_be_modelled_is_refused_naming_why(call, needle):
    with pytest.raises(ValueError, match=needle.replace("+", r"\+").replace(".", r"\.")):
        call()


def test_tied_survives_the_json_round_trip(tmp_path):
    path = tmp_path / "p.json"
    lm().to_json(str(path))
    assert Profile.from_json(str(path)).tied == ("wte.weight",)


def test_simulate_and_plan_take_the_split_from_the_command_line(tmp_path, capsys):
    prof = tmp_path / "p.json"
    lm().to_json(str(prof))
    out = tmp_path / "sim.json"
    assert main(["simulate", "--profile", str(prof), "--workers", "2", "--bandwidth", "1gbit", "--strategies",
                 "dynamic,dynamic+tied,planned,planned+tied", "--plan-time-limit", "1", "--json", str(out)]) == 0
    by = {r["strategy"]: r["step_time_s"] for r in json.loads(out.read_text())["results"]}
    assert by["dynamic+tied"] < by["dynamic"] and by["planned+tied"] < by["planned"]
    plan = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(prof), "--workers", "2", "--bandwidth", "1gbit", "--time-limit", "1",
                 "--split-tied", "--json", str(plan)]) == 0
    untied = tmp_path / "u.json"
    Profile(layers=lm().layers).to_json(str(untied))
    capsys.readouterr()
    assert main(["plan", "--profile", str(untied), "--workers", "2", "--bandwidth", "1gbit", "--split-tied",
                 "--json", str(tmp_path / "no.json")]) == 2
    assert "Profile.tied is empty" in capsys.readouterr().err


def test_advise_prices_the_split_where_the_profile_names_a_tied_embedding():
    topo = Topology.emulated(2, None, "1gbit")
    out = advise(lm(), topo)
    assert out["split_tied_speedup_vs_ddp"] > out["expected_speedup_vs_ddp"]
    reason = next(r for r in out["reasons"] if "wte.weight is a tied embedding" in r)
    assert f"{out['split_tied_step_s']:.3g} s" in reason
    plain = advise(Profile(layers=lm().layers), topo)
    assert plain["split_tied_step_s"] is None
    done = advise(lm().with_tied_split(), topo)  # e.g. opt.profile() of a run with the split on
    assert done["split_tied_step_s"] is None
    assert any("is split already" in r for r in done["reasons"])


def test_the_zoo_names_the_tied_embeddings_of_the_models_that_tie_them():
    from commsched.costmodel.zoo import zoo_profile

    assert zoo_profile("gpt2-xl").tied == ("embed.tokens.weight",)
    assert zoo_profile("bert-large").tied == ("embed.tokens.weight",)
    assert zoo_profile("gpt-7b").tied == ()  # Llama-shaped: an untied lm_head
    bert = zoo_profile("bert-large", tp=2).with_tied_split()  # the token table shares its layer: moved out
    assert [layer.name for layer in bert.layers[:2]] == ["embed[tied]", "embed"]
    topo = Topology.described("2x2", intra="100GB/s", inter="10gbit")
    gpt = zoo_profile("gpt2-xl", "h100")
    settings = SimSettings(partition_bytes=16 * MB, credit_bytes=64 * MB)
    assert (simulate(gpt, topo, "dynamic+tied", settings).step_time_s
            < simulate(gpt, topo, "dynamic", settings).step_time_s)


def test_a_split_tied_weight_is_never_fused_as_the_runtime_keeps_it_alone():
    from commsched.costmodel.simulator import fusion_runs

    layers = (LayerProfile("embed", 0.001, 0.002, (TensorSpec("wte.weight", 1000),)),
              LayerProfile("mix", 0.001, 0.002, (TensorSpec("mix.weight", 1000), TensorSpec("mix.bias", 10))))
    prof = Profile(layers=layers, tied=("wte.weight",))
    assert [[t.name for t in run] for run in fusion_runs(prof, 1 << 20)] == [["wte.weight", "mix.weight", "mix.bias"]]
    split = [[t.name for t in run] for run in fusion_runs(prof.with_tied_split(), 1 << 20)]
    assert split == [["wte.weight"], ["mix.weight", "mix.bias"]]
