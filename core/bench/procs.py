"""Worker processes with deadlines, signals turned into exceptions, ports, Horovod rendezvous.

Every wait here has a timeout; a worker that outlives it is killed by its pid
and named in the error. No process is ever found by name.

:func:`free_ports` and :func:`horovod_gloo_env` are the project's only copies:
benchmarks, launchers, tests and examples import them from here. The rendezvous
that needs Horovod itself is :mod:`commsched.plugins.horovod_gloo` (core imports
no Horovod).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: After the first worker fails, how long the others get to exit on their own
#: (their collectives usually error out once a peer's socket closes).
FAILURE_GRACE_S = 10.0


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived; raised in the main thread so cleanup runs."""


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`Terminated`.

    SIGINT already raises ``KeyboardInterrupt``. Together, every ``finally`` and
    ``__exit__`` of the block runs on Ctrl-C, ``kill``, or a closed terminal.
    The previous handlers are restored on exit. Only usable from the main thread.
    """

    def _raise(signum: int, _frame: object) -> None:
        raise Terminated(f"received {signal.Signals(signum).name}")

    previous = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class WorkerError(RuntimeError):
    """A worker failed or hung; the message names the ranks and their log tails."""


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class WorkerGroup:
    """Processes started together; :meth:`wait` or :meth:`kill` ends them all."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        commands: Sequence[Sequence[str]],
        envs: Sequence[Mapping[str, str]],
        logs: Sequence[str],
    ) -> WorkerGroup:
        """Start one process per command, stdout+stderr to the matching log file.

        Each gets its own session so a terminal's Ctrl-C reaches only the
        harness, which then ends them by pid (no half-dead worker printing a
        traceback over the report).
        """
        group = cls(logs=list(logs))
        try:
            for argv, env, log in zip(commands, envs, logs, strict=True):
                with open(log, "wb") as out:
                    group.procs.append(
                        subprocess.Popen(
                            list(argv), env=dict(env), stdout=out,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True,
                        )
                    )
        except BaseException:
            group.kill()
            raise
        return group

    @property
    def pids(self) -> list[int]:
        """Pids in rank order."""
        return [p.pid for p in self.procs]

    def kill(self) -> None:
        """SIGKILL every process still running (by pid) and reap it."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)

    def wait(
        self,
        timeout_s: float,
        on_tick: Callable[[], None] | None = None,
        tick_s: float = 0.25,
        grace_s: float = FAILURE_GRACE_S,
    ) -> None:
        """Wait until all exit 0; else kill the rest and raise :class:`WorkerError`.

        Raises when a worker exits non-zero (after ``grace_s`` for the others
        to exit too), or when ``timeout_s`` passes (hung workers are killed by
        pid and named). ``on_tick`` is called every ``tick_s`` (progress).
        Any exception, including ``KeyboardInterrupt``, kills the group.
        """
        deadline = time.monotonic() + timeout_s
        first_failure: float | None = None
        try:
            while True:
                codes = [p.poll() for p in self.procs]
                if all(c == 0 for c in codes):
                    return
                now = time.monotonic()
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed and first_failure is None:
                    first_failure = now
                running = [r for r, c in enumerate(codes) if c is None]
                if failed and (not running or now - first_failure > grace_s):
                    raise WorkerError(self._describe(failed, running, "failed"))
                if now > deadline:
                    raise WorkerError(
                        self._describe(failed, running, f"timed out after {timeout_s:.0f} s")
                    )
                if on_tick is not None:
                    on_tick()
                time.sleep(tick_s)
        except BaseException:
            self.kill()
            raise

    def _describe(self, failed: list[int], running: list[int], what: str) -> str:
        parts = [f"workers {what}:"]
        for r in failed:
            parts.append(
                f"- rank {r} (pid {self.procs[r].pid}) exited {self.procs[r].returncode};"
                f" log {self.logs[r]}:\n{_tail(self.logs[r])}"
            )
        for r in running:
            parts.append(
                f"- rank {r} (pid {self.procs[r].pid}) still running, killed;"
                f" log {self.logs[r]}:\n{_tail(self.logs[r], 5)}"
            )
        return "\n".join(parts)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` now.

    All ``n`` sockets are held open together while the ports are chosen, so no
    port repeats. The ports are released before returning: a caller binds them
    soon after (another process could in principle take one in between).
    """
    if n < 1:
        raise ValueError(f"free_ports needs n >= 1, got {n}")
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def horovod_gloo_env(master_addr: str, port: int | str, ifname: str, slot: Any) -> dict[str, str]:
    """The ``HOROVOD_*`` variables ``horovodrun --gloo`` sets for one worker.

    ``slot`` is a ``horovod.runner`` slot (``rank``, ``size``, ``local_rank``,
    ``local_size``, ``cross_rank``, ``cross_size``, ``hostname``); ``master_addr``
    and ``port`` are where the HTTP rendezvous server listens; ``ifname`` is the
    interface gloo uses. With these in ``os.environ``, ``hvd.init()`` joins the
    job without horovodrun.
    """
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": master_addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": ifname,
        "HOROVOD_HOSTNAME": slot.hostname,
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
    }


#: The file, in the run directory, through which rank 0 publishes the rendezvous port.
RENDEZVOUS_PORT_FILE = "horovod_rendezvous_port"


def pids_with_env(name: str, value: str) -> list[int]:
    """Live (non-zombie) processes whose environment holds ``name=value``: how a test or a
    driver finds every process of a job it tagged, without matching names."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found
