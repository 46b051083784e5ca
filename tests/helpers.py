"""Test helpers every test folder shares: free ports, commsched's own threads, workers under a deadline.

Import it as ``helpers`` (``from helpers import run_workers``): pyproject's pytest
``pythonpath`` puts ``tests/`` on ``sys.path`` for the test process, and
:func:`worker_env` puts it on ``PYTHONPATH`` for worker processes, so a worker
script can import it too. Keep it framework-free: core tests import it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from commsched.bench.procs import free_ports

__all__ = ["TESTS", "REPO", "commsched_threads", "free_port", "free_ports", "run_workers", "worker_env"]

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on ``host`` now (:func:`commsched.bench.procs.free_ports`)."""
    return free_ports(1, host)[0]


def commsched_threads() -> set[threading.Thread]:
    """The live threads commsched started in this process (every one's name starts with ``commsched``)."""
    return {t for t in threading.enumerate() if t.name.startswith("commsched")}


def worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus ``extra``, with ``tests/`` on ``PYTHONPATH`` (workers import helpers)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra or {})
    return env


def run_workers(commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], logs: Sequence[Path], *,
                timeout: float, cwd: Path | None = None) -> list[subprocess.CompletedProcess]:
    """Run one process per command (each in its own session, output to its log); return them once all exited.

    Raises ``TimeoutError`` naming the running workers, with every log's tail, if
    they are not all done within ``timeout`` seconds. Whatever the outcome, a
    worker still running is killed with its session (by the worker's pid, which
    is its session id: only processes it started).
    """
    procs: list[subprocess.Popen] = []
    try:
        for argv, env, log in zip(commands, envs, logs, strict=True):
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(list(argv), env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True))
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                running = [r for r, p in enumerate(procs) if p.poll() is None]
                raise TimeoutError(f"workers {running} still running after {timeout:.0f} s (a hang); logs:\n"
                                   + _tails(logs)) from None
        return [subprocess.CompletedProcess(p.args, p.returncode, Path(log).read_text(errors="replace"), "")
                for p, log in zip(procs, logs, strict=True)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def _tails(logs: Sequence[Path], chars: int = 3000) -> str:
    parts = []
    for rank, log in enumerate(logs):
        try:
            text = Path(log).read_text(errors="replace")[-chars:]
        except OSError:
            text = "(no log)"
        parts.append(f"--- worker {rank} ({log}) ---\n{text}")
    return "\n".join(parts)
