"""``commsched launch mxnet``: a parameter-server job on this machine.

Starts the ps-lite scheduler, ``--servers`` servers and ``--workers`` copies of the
user's command, each with the ``DMLC_*`` variables MXNet's ``dist_*`` KVStores
read, and stops every one of them (by pid, with its process group) when the
job ends, fails or is interrupted::

    commsched launch mxnet --workers 2 --servers 1 -- python train.py

The job succeeds when every worker exits with status 0; the servers and the
scheduler then leave by themselves. When a worker fails, the others get
``--grace`` seconds to stop on their own (commsched's timeouts make them fail with
a clear error instead of hanging), then everything still running is terminated.
No wait is unbounded: ``--timeout`` limits the whole job.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

from commsched.bench.procs import free_ports

__all__ = ["Job", "add_arguments", "run"]

log = logging.getLogger(__name__)

_POLL_S = 0.1
_STOP_S = 5.0  # SIGTERM -> SIGKILL
# The server and scheduler processes are MXNet itself: importing mxnet with
# DMLC_ROLE=server|scheduler runs the role and returns when the job is over.
# They run this interpreter (sys.executable), so they get whatever its
# environment provides for importing mxnet (the dev venv's numpy.bool shim).
_PS_ROLE_CODE = "import mxnet"


def _count(text: str) -> int:
    """A process count: an int >= 1 (argparse turns the ValueError into a usage error naming the option)."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(text)
    return value


def _seconds(positive: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise ValueError(text)
        return value
    parse.__name__ = "positive number of seconds" if positive else "number of seconds >= 0"
    return parse


_count.__name__ = "count >= 1"
_port.__name__ = "port 0..65535"


def _add_options(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    def default(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument("--workers", type=_count, default=default(1), help="worker processes (default 1)")
    parser.add_argument("--servers", type=_count, default=default(1), help="parameter-server processes (default 1)")
    parser.add_argument("--host", default=default("127.0.0.1"),
                        help="address every process binds and advertises (default 127.0.0.1, loopback)")
    parser.add_argument("--port", type=_port, default=default(0), help="ps-lite scheduler port (default: a free one)")
    parser.add_argument("--timeout", type=_seconds(positive=True), default=default(None),
                        help="stop the whole job after this many seconds (default: no limit)")
    parser.add_argument("--grace", type=_seconds(positive=False), default=default(30.0),
                        help="after a worker fails, seconds the others get to stop by themselves (default 30)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define ``commsched launch``'s arguments on ``parser`` (the ``launch`` subparser)."""
    _add_options(parser)
    parser.add_argument("framework", choices=["mxnet"], help="the framework of the job (only mxnet)")
    # Everything after the framework: options, then '--' and the worker command
    # (argparse cannot mix options with a trailing command; run() splits them).
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="[options] -- the worker command, e.g. -- python train.py")


def _split(args: argparse.Namespace) -> tuple[argparse.Namespace, list[str]]:
    rest = list(args.command)
    if "--" in rest:
        cut = rest.index("--")
        options, command = rest[:cut], rest[cut + 1:]
    elif rest and rest[0].startswith("-"):
        options, command = rest, []
    else:
        options, command = [], rest
    parser = argparse.ArgumentParser(prog="commsched launch mxnet", usage="%(prog)s [options] -- command ...",
                                     description="Start an MXNet parameter-server job on this machine.")
    _add_options(parser, defaults=False)
    parsed = parser.parse_args(options, namespace=argparse.Namespace(**vars(args)))
    return parsed, command


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.")


@dataclass
class _Proc:
    role: str
    index: int
    popen: subprocess.Popen

    @property
    def label(self) -> str:
        return f"{self.role} {self.index} (pid {self.popen.pid})"


class Job:
    """The processes of one parameter-server job; :meth:`stop` ends every one still running.

    Each process is started in its own session, so stopping one signals its whole
    process group (a worker command such as ``sh -c '...'`` and its children),
    found by the pid this job started, never by name.
    """

    def __init__(self, command: list[str], workers: int, servers: int, host: str = "127.0.0.1",
                 port: int = 0, env: dict[str, str] | None = None,
                 place: Callable[[str, int], tuple[list[str], dict[str, str]]] | None = None) -> None:
        if not command:
            raise ValueError("no worker command given; put it after '--', e.g. "
                             "commsched launch mxnet --workers 2 --servers 1 -- python train.py")
        if workers < 1 or servers < 1:
            raise ValueError(f"--workers={workers} and --servers={servers} must both be at least 1")
        self.command = list(command)
        self.workers = workers
        self.servers = servers
        self.host = host
        self.port = port or free_ports(1, host)[0]
        self.base_env = dict(os.environ if env is None else env)
        self.procs: list[_Proc] = []
        self.interrupted: int | None = None  # the signal that asked the job to stop
        # place(role, index) -> (command prefix, environment overrides): where a
        # process runs, e.g. ["ip", "netns", "exec", ns] and its DMLC_NODE_HOST.
        self.place = place

    def environment(self, role: str) -> dict[str, str]:
        """The environment of a process with DMLC_ROLE ``role``."""
        env = dict(self.base_env)
        env.update({
            "DMLC_ROLE": role,
            "DMLC_PS_ROOT_URI": self.host,
            "DMLC_PS_ROOT_PORT": str(self.port),
            "DMLC_NUM_SERVER": str(self.servers),
            "DMLC_NUM_WORKER": str(self.workers),
            # Without these ps-lite advertises the first non-loopback interface.
            "DMLC_NODE_HOST": self.host,
        })
        if _is_loopback(self.host):
            env["DMLC_INTERFACE"] = "lo"
        return env

    def start(self) -> None:
        """Start the scheduler, the servers and the workers (in that order)."""
        ps_cmd = [sys.executable, "-c", _PS_ROLE_CODE]
        roles = [("scheduler", 0, ps_cmd)] + [("server", i, ps_cmd) for i in range(self.servers)]
        roles += [("worker", i, self.command) for i in range(self.workers)]
        for role, index, cmd in roles:
            if self.interrupted is not None:
                return
            self._spawn(role, index, cmd)

    def _spawn(self, role: str, index: int, cmd: list[str]) -> None:
        env = self.environment(role)
        if self.place is not None:
            prefix, overrides = self.place(role, index)
            cmd = [*prefix, *cmd]
            env.update(overrides)
        try:
            popen = subprocess.Popen(cmd, env=env, start_new_session=True)
        except OSError as exc:
            raise RuntimeError(f"could not start the {role} ({' '.join(cmd)!r}): {exc}") from exc
        self.procs.append(_Proc(role, index, popen))
        log.debug("started %s", self.procs[-1].label)

    def running(self) -> list[_Proc]:
        """The processes that have not exited."""
        return [p for p in self.procs if p.popen.poll() is None]

    def wait(self, timeout: float | None, grace: float) -> int:
        """Wait for the job; return 0 when every worker succeeded, else the first failure's status.

        A failed worker, server or scheduler gives the others ``grace`` seconds to
        stop by themselves. Past ``timeout`` (None: none) the job counts as failed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        workers = [p for p in self.procs if p.role == "worker"]
        status = 0
        failed_at = None
        while True:
            if self.interrupted is not None:
                name = signal.Signals(self.interrupted).name
                print(f"commsched launch: {name}; stopping the job", file=sys.stderr, flush=True)
                return 128 + self.interrupted
            for proc in self.procs:
                code = proc.popen.poll()
                if code is not None and code != 0 and failed_at is None:
                    status = code if code > 0 else 128 - code
                    failed_at = time.monotonic()
                    print(f"commsched launch: {proc.label} exited with status {code}; "
                          f"stopping the job (others get {grace:g} s to stop by themselves)",
                          file=sys.stderr, flush=True)
            if all(p.popen.poll() is not None for p in workers):
                if failed_at is None:
                    # Success: the scheduler and servers leave once the workers finalized.
                    self._wait_all(min(grace, 30.0))
                return status
            if failed_at is not None and time.monotonic() - failed_at > grace:
                return status
            if deadline is not None and time.monotonic() > deadline:
                print(f"commsched launch: the job ran past --timeout={timeout:g} s; stopping it",
                      file=sys.stderr, flush=True)
                return 124
            time.sleep(_POLL_S)

    def _wait_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            time.sleep(_POLL_S)

    def stop(self) -> None:
        """Terminate every process still running (SIGTERM, then SIGKILL after a few seconds); reap all."""
        alive = self.running()
        for proc in alive:
            self._signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_S
        while any(p.popen.poll() is None for p in alive) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        for proc in alive:
            if proc.popen.poll() is None:
                print(f"commsched launch: {proc.label} ignored SIGTERM; killing it", file=sys.stderr, flush=True)
                self._signal(proc, signal.SIGKILL)
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=_STOP_S)
            except subprocess.TimeoutExpired:
                log.error("%s did not exit after SIGKILL", proc.label)
        # Children a process left behind in its group are signalled too.
        for proc in self.procs:
            self._signal(proc, signal.SIGKILL, group_only=True)

    @staticmethod
    def _signal(proc: _Proc, sig: int, group_only: bool = False) -> None:
        try:
            os.killpg(proc.popen.pid, sig)  # its own session: pgid == pid
        except ProcessLookupError:
            pass
        except PermissionError:
            if not group_only:
                proc.popen.send_signal(sig)


def run(args: argparse.Namespace) -> int:
    """Run ``commsched launch``: start the job, wait for it, stop whatever is left. Returns the exit status.

    SIGINT (Ctrl-C) and SIGTERM only set a flag that the wait loop reads, so a
    signal can never land between starting a process and recording its pid.
    """
    args, command = _split(args)
    try:
        job = Job(command, workers=args.workers, servers=args.servers, host=args.host, port=args.port)
    except (ValueError, OSError) as exc:
        print(f"commsched launch: {exc}", file=sys.stderr)
        return 2

    def on_signal(signum: int, frame: object) -> None:
        job.interrupted = signum

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    status = 1
    try:
        job.start()
        status = job.wait(args.timeout, args.grace)
    except RuntimeError as exc:
        print(f"commsched launch: {exc}", file=sys.stderr, flush=True)
        status = 1
    finally:
        try:
            job.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return status
