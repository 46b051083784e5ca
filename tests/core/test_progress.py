"""commsched.progress: a bar on a terminal (rich, or the plain fallback), nothing of it in logs or CI."""

import io
import os
import pty
import select
import subprocess
import sys
import textwrap
import time

import pytest

from commsched.progress import Progress, wanted

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def outside_ci(monkeypatch):
    """Each test says which environment it means: CI runs this suite with CI=true (and may set TERM=dumb)."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("env,expected", [
    ({}, True), ({"CI": "true"}, False), ({"CI": "1"}, False), ({"CI": "0"}, True), ({"CI": "false"}, True),
    ({"CI": ""}, True), ({"TERM": "dumb"}, False), ({"TERM": "xterm-256color"}, True),
])
def test_wanted_needs_a_terminal_outside_ci(env, expected):
    assert wanted(_Tty(), env) is expected
    assert wanted(io.StringIO(), env) is False  # never off a terminal


def test_wanted_on_a_closed_stream_is_false():
    stream = open(os.devnull, "w")
    stream.close()
    assert wanted(stream, {}) is False


def test_off_a_terminal_only_notes_are_written():
    out = io.StringIO()
    with Progress("work", 3, stream=out) as bar:
        for i in range(3):
            bar.update(i + 1, description=f"step {i}")
        bar.note("phase done")
    assert out.getvalue() == "phase done\n"


def test_plain_bar_redraws_in_place_and_keeps_notes():
    out = _Tty()
    with Progress("work", 4, stream=out, use_rich=False) as bar:
        bar.update(2)
        bar.note("half way")
        bar.update(4)
    text = out.getvalue()
    assert "\r" in text and "work [" in text
    assert "[############............] 2/4" in text and "[########################] 4/4" in text
    assert "half way\n" in text
    assert text.endswith("\n")  # a finished, non-transient bar stays on its own line


def test_a_bar_inside_another_draws_nothing_and_notes_through_the_outer():
    out, inner_out = _Tty(), _Tty()
    with Progress("outer", 2, stream=out, use_rich=False) as outer:
        with Progress("inner", 5, stream=inner_out, use_rich=False) as inner:
            inner.update(3)
            inner.note("inner result")
        outer.update(1)
    assert inner_out.getvalue() == ""
    assert "inner result\n" in out.getvalue()


def test_negative_total_is_refused():
    with pytest.raises(ValueError, match="total"):
        Progress("x", -1, stream=io.StringIO())


# ------------------------------------------------------------------ real terminals (pty)
_SCRIPT = textwrap.dedent("""
    import sys
    {block}
    from commsched.progress import Progress
    with Progress("work", 3) as bar:
        for i in range(3):
            bar.update(i + 1)
        bar.note("a note")
    print("END", file=sys.stderr)
""")


def _run_on_pty(code: str, env_extra: dict, timeout: float = 60) -> bytes:
    """Run ``code`` with stdout and stderr on a pseudo-terminal; everything it wrote."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "TERM", "FORCE_COLOR", "TTY_COMPATIBLE")}
    env.update(env_extra)
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=slave, stdout=slave, stderr=slave, env=env,
                            close_fds=True)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    assert proc.returncode == 0, out.decode(errors="replace")
    return out


@pytest.mark.parametrize("block", ["", "sys.modules['rich'] = None  # the plain fallback"], ids=["rich", "plain"])
def test_on_a_terminal_a_bar_is_drawn(block):
    pytest.importorskip("rich") if not block else None
    out = _run_on_pty(_SCRIPT.format(block=block), {"TERM": "xterm"})
    assert b"\r" in out and b"work" in out and b"3/3" in out
    assert b"a note" in out and b"END" in out


@pytest.mark.parametrize("block", ["", "sys.modules['rich'] = None"], ids=["rich", "plain"])
def test_on_a_terminal_under_ci_only_the_notes_appear(block):
    out = _run_on_pty(_SCRIPT.format(block=block), {"TERM": "xterm", "CI": "true"})
    assert out.replace(b"\r\n", b"\n") == b"a note\nEND\n"


def test_core_imports_and_draws_without_rich():
    code = textwrap.dedent("""
        import io, sys
        sys.modules["rich"] = None
        import commsched, commsched.progress, commsched.tuner, commsched.bench.runner, commsched.costmodel.plan_cli
        class Tty(io.StringIO):
            def isatty(self): return True
        out = Tty()
        with commsched.progress.Progress("x", 2, stream=out) as bar:
            bar.update(2)
        assert "[########################] 2/2" in out.getvalue(), repr(out.getvalue())
        try:
            commsched.progress.Progress("x", 1, stream=out, use_rich=True)
        except ImportError as exc:
            assert "pip install commsched[progress]" in str(exc)
        else:
            raise AssertionError("use_rich=True without rich must raise")
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr


# ------------------------------------------------------------------ the users of the bar
def test_tuner_draws_its_samples_on_a_terminal_and_nothing_under_ci():
    code = textwrap.dedent("""
        from commsched.tuner import Settings, Tuner

        class Fixed:  # a sampler that proposes one setting: no Optuna needed
            def ask(self):
                return Settings("fifo", 1 << 20, 1 << 22, 0)
            def tell(self, settings, score):
                pass

        tuner = Tuner(Settings("dynamic", 1 << 20, 1 << 22, 0), sampler=Fixed(), sample_steps=2, settle=0,
                      max_samples=3, patience=1, check_every=2)
        decision = tuner.first(0)
        step = 0
        while tuner.phase == "tuning":
            for s in range(step + 1, decision.next + 1):
                tuner.observe(s, 0.1)
            step = decision.next
            decision = tuner.decide(step)
        tuner.close()
        print("SETTLED", tuner.samples)
    """)
    out = _run_on_pty(code, {"TERM": "xterm"})
    assert b"commsched tuner" in out and b"kept" in out and b"SETTLED" in out
    quiet = _run_on_pty(code, {"TERM": "xterm", "CI": "true"})
    assert b"commsched tuner" not in quiet and b"SETTLED" in quiet


def test_make_plan_reports_every_stage_in_order_and_each_candidate():
    pytest.importorskip("highspy")
    from commsched.costmodel.planner import PLAN_STAGES, PlanSearch, make_plan
    from commsched.costmodel.topology import Topology
    from commsched.costmodel.zoo import zoo_profile

    profile = zoo_profile("resnet50")
    topology = Topology.emulated(2, None, "1gbit")
    calls = []
    result = make_plan(profile, topology, PlanSearch.for_profile(profile, time_limit_s=1.0),
                       progress=lambda stage, done, scored: calls.append((stage, done, scored)))
    stages = [c[0] for c in calls]
    assert [s for i, s in enumerate(stages) if i == 0 or stages[i - 1] != s] == list(PLAN_STAGES)
    assert all(PLAN_STAGES.index(stage) == done for stage, done, _ in calls)
    scored = [c[2] for c in calls]
    assert scored == sorted(scored) and scored[-1] == result.candidates
