"""Machine-wide CPU busy fraction from ``/proc/stat``.

On the emulated cluster the CPUs, not the links, become the bottleneck above a
few Gbit/s (measured on 2 cores: docs/bench.md, Limits), so every measurement reports how busy they were.
``/proc/stat`` is not namespaced: the number covers the whole machine,
including other users' load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

#: Above this busy fraction, timings measure the CPU rather than the network.
BUSY_WARNING = 0.9


@dataclass(frozen=True)
class CpuTimes:
    """Aggregate jiffies of all CPUs at one moment."""

    busy: int
    total: int
    steal: int = 0  # taken by the hypervisor for other guests: counted busy, but not ours


def read_cpu_times(path: str = "/proc/stat") -> CpuTimes:
    """The first ``cpu`` line of ``/proc/stat``: idle + iowait are not busy."""
    with open(path) as f:
        fields = f.readline().split()
    if not fields or fields[0] != "cpu":
        raise ValueError(f"{path} does not start with an aggregate 'cpu' line")
    # user nice system idle iowait irq softirq steal [guest guest_nice]; guest
    # time is already counted in user/nice, so only the first eight add up.
    values = [int(v) for v in fields[1:9]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values)
    steal = values[7] if len(values) > 7 else 0
    return CpuTimes(busy=total - idle, total=total, steal=steal)


def _share(start: CpuTimes, end: CpuTimes, field: str) -> float | None:
    """Fraction in [0, 1] of all CPU time between two readings spent in ``field``; ``None``
    when no jiffy passed (too short an interval to say)."""
    total = end.total - start.total
    if total <= 0:
        return None
    return min(1.0, max(0.0, (getattr(end, field) - getattr(start, field)) / total))


def busy_fraction(start: CpuTimes, end: CpuTimes) -> float | None:
    """Fraction in [0, 1] of CPU time spent busy between two readings (``None``: no jiffy passed)."""
    return _share(start, end, "busy")


def steal_fraction(start: CpuTimes, end: CpuTimes) -> float | None:
    """Fraction in [0, 1] of CPU time the hypervisor gave to other guests between two readings.

    On a shared virtual machine this is the slowdown nobody on the machine caused: a phase
    with steal well above another's ran on less CPU. ``None`` when no jiffy passed.
    """
    return _share(start, end, "steal")


class CpuWindow:
    """CPU use over an interval: the machine's busy fraction and this process's
    own CPU seconds (all its threads), to tell our load from other users'."""

    def __init__(self) -> None:
        self._machine = read_cpu_times()
        self._process = time.process_time()
        self._wall = time.perf_counter()

    def stop(self) -> dict[str, float | None]:
        """``cpu_busy`` and ``cpu_steal`` (machine-wide fractions, steal included in busy),
        ``process_cpu_s`` and ``wall_s`` since start."""
        now = read_cpu_times()
        return {
            "cpu_busy": busy_fraction(self._machine, now),
            "cpu_steal": steal_fraction(self._machine, now),
            "process_cpu_s": time.process_time() - self._process,
            "wall_s": time.perf_counter() - self._wall,
        }
