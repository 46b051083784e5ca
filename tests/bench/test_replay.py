"""``commsched.bench.replay``: a run's traces replayed on the cost model's network."""

from __future__ import annotations

import json

import pytest

from commsched.bench.replay import load_pieces, main, replay
from commsched.costmodel.collectives import allreduce_s
from commsched.costmodel.topology import Topology

MB = 1 << 20
FLAT = Topology.emulated(2, None, "1gbit")
PIECE_S = allreduce_s(FLAT, MB)


def write_traces(tmp_path, strategy: str, ranks: list[list[tuple[int, str, float, float, float]]]) -> str:
    """Each rank's pieces as (step, name, ready s, issue s, land s), written as the runtime's Chrome trace."""
    for r, pieces in enumerate(ranks):
        events = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}}]
        for step, name, ready, issue, land in pieces:
            events.append({"name": name, "cat": "QUEUED", "ph": "X", "ts": ready * 1e6, "dur": (issue - ready) * 1e6,
                           "pid": r, "tid": 1, "args": {"step": step}})
            events.append({"name": name, "cat": "COMM", "ph": "X", "ts": issue * 1e6, "dur": (land - issue) * 1e6,
                           "pid": r, "tid": 2, "args": {"bytes": MB, "step": step}})
        (tmp_path / f"{strategy}.rank{r}.json").write_text(json.dumps({"traceEvents": events}))
    return str(tmp_path)


def lockstep(steps: int, per_step: int, gap_s: float) -> list[tuple[int, str, float, float, float]]:
    """Pieces issued back to back on a free link, each landing after its closed form; ``gap_s`` between steps."""
    out, t = [], 1.0
    for s in range(steps):
        for i in range(per_step):
            out.append((s, f"w#{i}", t, t, t + PIECE_S))
            t += PIECE_S
        t += gap_s
    return out


def test_traces_the_network_model_explains_replay_to_the_measured_landings(tmp_path):
    pieces = lockstep(3, 4, gap_s=0.05)
    directory = write_traces(tmp_path, "dynamic_1MiB_4MiB", [pieces, pieces])
    loaded = load_pieces(directory, "dynamic:1MiB/4MiB", 2)  # the bench's file name for that strategy
    assert len(loaded) == 12 and loaded[0].ready == (1.0, 1.0)
    result = replay(loaded, FLAT)
    assert result.link == "inter" and len(result.steps) == 3
    assert all(abs(s.error_s) < 1e-9 for s in result.steps)
    assert [s.pieces for s in result.steps] == [4, 4, 4]
    # after the first step: two steps of 4 pieces on the link, one 50 ms gap between them, nothing ready in it
    assert result.busy_s == pytest.approx(8 * PIECE_S)
    assert result.window_s - result.busy_s == pytest.approx(0.05)
    assert result.starved_s == pytest.approx(0.05) and result.held_s == pytest.approx(0.0, abs=1e-12)


def test_a_piece_ready_everywhere_but_issued_late_holds_the_link_and_a_late_rank_delays_the_landing(tmp_path):
    fast = lockstep(3, 2, gap_s=0.0)
    # rank 1 issues the third step's pieces 30 ms after they were ready (its credit was full); a
    # collective starts when the last rank issues it, so that step lands 30 ms late on both ranks
    late = {(2, "w#0"): 0.03, (2, "w#1"): 0.03}
    rank0 = [(s, n, r, i, land + (0.03 if s == 2 else 0.0)) for s, n, r, i, land in fast]
    rank1 = [(s, n, r, i + late.get((s, n), 0.0), land + (0.03 if s == 2 else 0.0)) for s, n, r, i, land in fast]
    result = replay(load_pieces(write_traces(tmp_path, "dynamic", [rank0, rank1]), "dynamic", 2), FLAT)
    assert all(abs(s.error_s) < 1e-9 for s in result.steps)
    assert result.held_s == pytest.approx(0.03) and result.starved_s == pytest.approx(0.0, abs=1e-12)


def test_a_slow_network_shows_as_measured_landings_after_the_replayed_ones(tmp_path):
    pieces = [(s, n, r, i, i + 1.5 * (land - i)) for s, n, r, i, land in lockstep(2, 3, gap_s=0.1)]
    result = replay(load_pieces(write_traces(tmp_path, "fifo", [pieces, pieces]), "fifo", 2), FLAT)
    assert result.steps[-1].error_s == pytest.approx(0.5 * PIECE_S, rel=1e-6)


def test_two_level_pieces_hold_the_inter_node_link_for_their_middle_phase_only(tmp_path):
    topo = Topology.emulated(4, 2, "500mbit")
    pieces = [(0, "w#0", 1.0, 1.0, 2.0)]
    directory = write_traces(tmp_path, "planned", [pieces] * 4)
    ring = replay(load_pieces(directory, "planned", 4), topo, "ring")
    two = replay(load_pieces(directory, "planned", 4), topo, "hierarchical")
    assert ring.steps[0].replayed_s == pytest.approx(allreduce_s(topo, MB, "ring"))
    assert two.steps[0].replayed_s == pytest.approx(allreduce_s(topo, MB, "hierarchical"))


def test_bad_input_names_the_file_and_the_fix(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"dynamic\.rank1\.json.*--timeline DIR"):
        write_traces(tmp_path, "dynamic", [lockstep(1, 1, 0.0)])
        load_pieces(str(tmp_path), "dynamic", 2)
    (tmp_path / "fifo.rank0.json").write_text("{}")
    (tmp_path / "fifo.rank1.json").write_text("{}")
    with pytest.raises(ValueError, match="not a commsched timeline"):
        load_pieces(str(tmp_path), "fifo", 2)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        load_pieces(str(tmp_path), "fifo", 1)
    with pytest.raises(ValueError, match="algorithm 'tree'"):
        replay(load_pieces(write_traces(tmp_path, "static", [lockstep(1, 1, 0.0)] * 2), "static", 2), FLAT, "tree")
    assert main([str(tmp_path), "--strategy", "sync", "--workers", "2", "--bandwidth", "1gbit"]) == 2
    assert "sync.rank0.json" in capsys.readouterr().err


def test_the_command_prints_the_steps_and_writes_json(tmp_path, capsys):
    pieces = lockstep(3, 2, gap_s=0.02)
    directory = write_traces(tmp_path, "dynamic", [pieces, pieces])
    out = tmp_path / "replay.json"
    assert main([directory, "--strategy", "dynamic", "--workers", "2", "--bandwidth", "1gbit",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 2 | 2 |" in text and "starved 0.02 s" in text
    data = json.loads(out.read_text())
    assert data["strategy"] == "dynamic" and len(data["steps"]) == 3 and data["steps"][0]["error_s"] == 0.0
