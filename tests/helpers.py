"""Test helpers every test folder shares: free ports, commsched's own threads, workers under a deadline.

Import it as ``helpers`` (``from helpers import run_workers``): pyproject's pytest
``pythonpath`` puts ``tests/`` on ``sys.path`` for the test process, and
:func:`worker_env` puts it on ``PYTHONPATH`` for worker processes, so a worker
script can import it too. Keep it framework-free: core tests import it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from commsched.bench.procs import free_ports

__all__ = ["TESTS", "REPO", "Finished", "assert_clean_exit", "assert_partitioned_within_credit", "commsched_threads",
           "free_port", "free_ports", "horovod_or_skip", "horovodrun", "run_workers", "train_beside_reference",
           "worker_env"]

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
_MARKER_POLL_S = 0.1  # how often run_workers looks for a worker's marker files
HOROVODRUN = Path(sys.executable).with_name("horovodrun")


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on ``host`` now (:func:`commsched.bench.procs.free_ports`)."""
    return free_ports(1, host)[0]


def init_one_rank_group() -> None:
    """A torch.distributed world of one gloo rank in this process (torch imported here, on use)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def commsched_threads() -> set[threading.Thread]:
    """The live threads commsched started in this process (every one's name starts with ``commsched``)."""
    return {t for t in threading.enumerate() if t.name.startswith("commsched")}


def worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus ``extra``, with ``tests/`` on ``PYTHONPATH`` (workers import helpers)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra or {})
    return env


class Finished(subprocess.CompletedProcess):
    """A worker that exited: ``returncode``, ``stdout`` (its log) and ``exit_s``, the seconds from
    its last marker file's write to its exit (None without markers)."""

    def __init__(self, args: Any, returncode: int, stdout: str, exit_s: float | None) -> None:
        super().__init__(args, returncode, stdout, "")
        self.exit_s = exit_s


def run_workers(commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], logs: Sequence[Path], *,
                timeout: float, cwd: Path | None = None, markers: Sequence[Sequence[Path]] | None = None,
                exit_within: float | None = None) -> list[Finished]:
    """Run one process per command (each in its own session, output to its log); return them once all exited.

    Raises ``TimeoutError`` naming the running workers, with every log's tail, if
    they are not all done within ``timeout`` seconds. With ``markers`` (per worker,
    the files its program writes when its main code returned) and ``exit_within``,
    a worker must also exit within ``exit_within`` seconds of writing the last of
    its markers, else ``TimeoutError``: that is how a test proves interpreter exit
    does not hang. Whatever the outcome, a worker still running is killed with its
    session (by the worker's pid, which is its session id: only processes it started).
    """
    if (markers is None) != (exit_within is None):
        raise ValueError("markers and exit_within go together")
    procs: list[subprocess.Popen] = []
    exit_s: list[float | None] = [None] * len(commands)
    try:
        for argv, env, log in zip(commands, envs, logs, strict=True):
            with open(log, "wb") as out:
                # PYTHONFAULTHANDLER: a hung worker prints every thread's stack into its log when
                # _dump_stacks aborts it, so the test's failure says where it hung
                procs.append(subprocess.Popen(list(argv), env={"PYTHONFAULTHANDLER": "1", **env}, stdout=out,
                                              stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True))
        deadline = time.monotonic() + timeout
        for rank, proc in enumerate(procs):
            while True:
                left = deadline - time.monotonic()
                try:
                    proc.wait(timeout=max(0.01, min(left, _MARKER_POLL_S if markers else left)))
                except subprocess.TimeoutExpired:
                    pass
                returned = _marked(markers[rank]) if markers else None
                if proc.returncode is not None:
                    if returned is not None:
                        exit_s[rank] = time.time() - returned
                    break
                if returned is not None and time.time() - returned > exit_within:
                    _dump_stacks([proc])
                    raise TimeoutError(f"worker {rank} still running {exit_within:.0f} s after its main code "
                                       "returned (exit hangs); logs:\n" + _tails(logs))
                if time.monotonic() > deadline:
                    running = [r for r, p in enumerate(procs) if p.poll() is None]
                    _dump_stacks([procs[r] for r in running])
                    raise TimeoutError(f"workers {running} still running after {timeout:.0f} s (a hang); logs:\n"
                                       + _tails(logs))
        return [Finished(p.args, p.returncode, Path(log).read_text(errors="replace"), exit_s[rank])
                for rank, (p, log) in enumerate(zip(procs, logs, strict=True))]
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def train_beside_reference(model: Any, opt: Any, ref: Any, ref_opt: Any, batches: Sequence[Any],
                           before_forward: Any = None) -> list[bool]:
    """Train ``model`` with commsched's ``opt`` and ``ref`` with the plain ``ref_opt`` on the same
    ``batches`` (loss: the output's mean square); ``before_forward()`` runs before each batch's two
    forwards. Synchronizes and closes ``opt``; returns, per parameter, whether the two are bitwise
    equal. (PyTorch is imported here, when called: this module stays framework-free.)"""
    import torch

    for x in batches:
        if before_forward is not None:
            before_forward()
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    opt.synchronize()
    opt.close()
    return [torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True)]


def assert_clean_exit(finished: Sequence[Finished], bound_s: float) -> None:
    """Every worker exited 0 within ``bound_s`` of writing its markers (see :func:`run_workers`)."""
    for rank, proc in enumerate(finished):
        assert proc.returncode == 0, f"worker {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
        assert proc.exit_s is not None and proc.exit_s <= bound_s, proc.exit_s


def assert_partitioned_within_credit(per_step: Mapping[Any, Mapping[str, Any]], expected: Mapping[str, int],
                                     max_in_flight_bytes: int, credit_bytes: int | None, what: str) -> None:
    """Every recorded step (``Scheduler.stats()["per_step"]``) started each piece ``name#i`` of
    ``expected`` (tensor name -> piece_bounds' count) exactly once and nothing else, so every
    tensor above the piece size was split; and, unless ``credit_bytes`` is None (a rank that
    does not pace), the bytes in flight never exceeded the credit."""
    assert any(n > 1 for n in expected.values()), f"{what}: no tensor to split in {expected}"
    assert per_step, f"{what}: no step recorded"
    from collections import Counter

    want = Counter(f"{name}#{i}" for name, n in expected.items() for i in range(n))
    for step, seen in per_step.items():
        started = Counter(seen["order"])
        assert started == want, f"{what} step {step}: started {dict(started)}, want {dict(expected)} pieces"
    if credit_bytes is not None:
        assert 0 < max_in_flight_bytes <= credit_bytes, (
            f"{what}: {max_in_flight_bytes} bytes in flight, credit {credit_bytes}")


def _marked(paths: Sequence[Path]) -> float | None:
    """When the last of ``paths`` was written (wall clock), or None while one is missing."""
    try:
        return max(Path(p).stat().st_mtime for p in paths)
    except (FileNotFoundError, ValueError):
        return None


@functools.lru_cache(maxsize=None)
def _horovod_problem(framework: str) -> str | None:
    code = f"import horovod.{framework} as hvd; hvd.init(); hvd.shutdown()"
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env=worker_env({"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}))
    if probe.returncode != 0:
        return (probe.stderr.strip().splitlines() or ["no output"])[-1]
    return None


def horovod_or_skip(framework: str) -> None:
    """Skip the test unless ``horovod.<framework>`` imports and initialises here (under ``CI=true``: fail).

    Checked once per framework, in a subprocess (Horovod loads a C library that may abort).
    """
    why = _horovod_problem(framework)
    if why is not None:
        message = (f"horovod.{framework} is not usable here ({why}); `make horovod` builds Horovod 0.28.1 with "
                   "PyTorch, TensorFlow and MXNet support")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def horovodrun(np: int, *argv: str) -> list[str]:
    """The command that runs ``python argv...`` on ``np`` local Horovod ranks over gloo."""
    return [str(HOROVODRUN), "-np", str(np), "-H", f"localhost:{np}", "--gloo", sys.executable, *argv]


def _dump_stacks(procs: Sequence[subprocess.Popen], wait_s: float = 5.0) -> None:
    """SIGABRT to each still-running worker (only the process started, not its session): a
    Python one with the fault handler on writes every thread's stack to its log, then dies. Both
    hang checks of :func:`run_workers` (past the timeout; not exiting after its markers) call it."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGABRT)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)


def _tails(logs: Sequence[Path], chars: int = 3000) -> str:
    parts = []
    for rank, log in enumerate(logs):
        try:
            text = Path(log).read_text(errors="replace")[-chars:]
        except OSError:
            text = "(no log)"
        parts.append(f"--- worker {rank} ({log}) ---\n{text}")
    return "\n".join(parts)
