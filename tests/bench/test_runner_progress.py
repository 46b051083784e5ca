"""The bench runner's progress: a bar per phase on a terminal, one outcome line per phase in a log."""

from __future__ import annotations

import io
import textwrap

import pytest

from commsched.bench.netns import LoopbackCluster
from commsched.bench.runner import RunConfig, Runner

pytestmark = pytest.mark.timeout(120)

# A stand-in worker (run as ``python -m``): reports progress as rank 0 of a real worker does
# (plugins/torch/bench/worker.py), waits long enough for the runner's 0.25 s ticks to see it,
# and writes its result.
_WORKER = textwrap.dedent("""
    import argparse, json, os, time
    p = argparse.ArgumentParser()
    p.add_argument("--spec"); p.add_argument("--rank", type=int)
    a = p.parse_args()
    spec = json.load(open(a.spec))
    for done in (1, 2, 3):
        with open(os.path.join(spec["run_dir"], "progress.tmp"), "w") as f:
            json.dump({"phase": "steps", "done": done, "total": 3}, f)
        os.replace(os.path.join(spec["run_dir"], "progress.tmp"), os.path.join(spec["run_dir"], "progress"))
        time.sleep(0.4)
    json.dump({"ok": True}, open(os.path.join(spec["run_dir"], f"rank{a.rank}.json"), "w"))
""")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run_phase(tmp_path, monkeypatch, log) -> str:
    (tmp_path / "fake_bench_worker.py").write_text(_WORKER)
    monkeypatch.chdir(tmp_path)  # the runner puts the working directory on the workers' PYTHONPATH
    config = RunConfig(workload="tiny", workers=1, nodes=1, bandwidth=None, intra_bandwidth=None, strategies=[],
                       steps=3, warmup=0, batch_size=1, partition_bytes=1 << 20, credit_bytes=4 << 20,
                       network="loopback", phase_timeout_s=60)
    work = tmp_path / "work"
    work.mkdir()
    phase = Runner(config, LoopbackCluster(1), str(work), worker_module="fake_bench_worker", log=log).run_phase(
        0, "baseline", "baseline")
    assert phase.status == "ok", phase.reason
    return log.getvalue()


@pytest.mark.parametrize("use_rich", [True, False], ids=["rich", "plain"])
def test_a_phase_draws_its_steps_on_a_terminal(tmp_path, monkeypatch, use_rich):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("TERM", raising=False)
    if use_rich:
        pytest.importorskip("rich")
    else:
        monkeypatch.setattr("commsched.progress._rich_progress", lambda: None)
    text = _run_phase(tmp_path, monkeypatch, _Tty())
    assert "\r" in text and "[1/1] baseline steps" in text  # redrawn in place, with the worker's phase
    assert "2/3" in text  # a step count between start and end: drawn while the phase ran
    assert "[1/1] baseline: done\n" in text


def test_in_a_log_or_ci_a_phase_writes_only_its_outcome(tmp_path, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert _run_phase(tmp_path, monkeypatch, io.StringIO()) == "[1/1] baseline: done\n"
    monkeypatch.setenv("CI", "true")
    ci = tmp_path / "ci"
    ci.mkdir()
    assert _run_phase(ci, monkeypatch, _Tty()) == "[1/1] baseline: done\n"  # a terminal, but under CI
