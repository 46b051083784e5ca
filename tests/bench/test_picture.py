"""The timeline picture reads both trace kinds and writes a PNG of the last steps."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from commsched.bench.picture import draw_timeline, lanes_from_trace  # noqa: E402
from commsched.costmodel.profile import LayerProfile, Profile, TensorSpec  # noqa: E402
from commsched.costmodel.simulator import simulate  # noqa: E402
from commsched.costmodel.topology import Link, Topology  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def _runtime_trace() -> list[dict]:
    """What commsched.timeline writes: COMM (2), UPDATE (3), WAIT (4) lanes and step markers."""
    events = []
    for step in range(3):
        t = step * 100_000.0
        events += [{"name": f"w#{i}", "ph": "X", "pid": 0, "tid": 2, "ts": t + 10_000 * i, "dur": 30_000}
                   for i in range(3)]
        events += [{"name": "WAIT", "ph": "X", "pid": 0, "tid": 4, "ts": t + 60_000, "dur": 20_000},
                   {"name": "UPDATE", "ph": "X", "pid": 0, "tid": 3, "ts": t + 80_000, "dur": 5_000},
                   {"name": f"step {step} end", "ph": "i", "pid": 0, "tid": 0, "ts": t + 99_000}]
    return events


def test_runtime_trace_lanes_and_picture(tmp_path):
    ranks, marks = lanes_from_trace(_runtime_trace())
    assert list(ranks) == [0] and len(marks) == 3
    lanes = ranks[0]
    assert len(lanes["network"]) == 9 and len(lanes["wait"]) == 3 and len(lanes["compute"]) == 3
    assert lanes["wait"][0][:2] == pytest.approx((0.06, 0.08))
    out = draw_timeline(_runtime_trace(), str(tmp_path / "rt.png"), title="runtime")
    assert open(out, "rb").read(8) == PNG


def test_simulated_trace_picture_marks_the_exposed_waits(tmp_path):
    layers = tuple(LayerProfile(f"l{i}", 0.01, 0.02, (TensorSpec(f"l{i}.w", 1 << 20),)) for i in range(3))
    link = Link(1e-4, 1e8)
    result = simulate(Profile(layers=layers), Topology(2, 1, link, link), "dynamic")
    ranks, marks = lanes_from_trace(result.trace)
    assert ranks[0]["simulated"] and len(marks) >= 3
    waited = sum(e - s for s, e, _ in ranks[0]["wait"])
    assert waited == pytest.approx(sum(e["dur"] for e in result.trace if e["name"] == "WAIT") / 1e6)
    out = draw_timeline(result.trace, str(tmp_path / "sim.png"))
    assert open(out, "rb").read(8) == PNG


def test_an_empty_trace_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="no spans"):
        draw_timeline([], str(tmp_path / "x.png"))
