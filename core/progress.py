"""Progress of long runs (``commsched bench``, ``validate``, ``plan``, the online tuner).

One bar, redrawn in place, on a terminal; nothing of it in logs or CI. Decision: drawn with
`rich <https://github.com/Textualize/rich>`_ when it is installed (``pip install
commsched[progress]``), else with a plain one-line text bar, so the core imports and every command
runs without it. rich rather than tqdm: rich keeps lines printed during the run (:meth:`Progress.note`)
above the bar instead of tearing it, redraws only when told (no refresh thread: the house rule is
that every thread is named and joined), and is already pinned beside TensorFlow (Keras 3 depends on
it, so ``requirements/constraints.txt`` had rich 15.0.0 before commsched asked for it).

Whether anything is drawn is decided once per bar by :func:`wanted`: the stream must be a
terminal (``isatty()``), ``CI`` must be unset (or ``0``/``false``: GitHub Actions, GitLab, Jenkins
and Buildkite all set ``CI``), and ``TERM`` must not be ``dumb``. :meth:`Progress.note` lines (a
phase's result) are written either way: a log gets one line per phase, never a redraw.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, TextIO

from commsched.config import read_terminal_environment

__all__ = ["Progress", "wanted", "RICH_EXTRA"]

#: What a user installs for the rich bar (the plain bar needs nothing).
RICH_EXTRA = "commsched[progress]"

_PLAIN_WIDTH = 24
# The bars open in this process, outermost first: one terminal shows one bar, so a bar opened
# inside another (validate's probe and profile phases, a bench phase inside a run) draws nothing
# and writes its notes through the outer one.
_open: list["Progress"] = []
_open_lock = threading.Lock()
_MIN_INTERVAL_S = 0.1  # a bar redraws at most this often, unless forced


def wanted(stream: TextIO | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a progress bar should be drawn on ``stream`` (default ``sys.stderr``).

    True only for a terminal, outside CI (``CI`` unset, empty, ``0`` or ``false``) and when
    ``TERM`` is not ``dumb``. ``environ`` defaults to the process environment, read through
    :func:`commsched.config.read_terminal_environment` (config reads the environment, nothing else).
    """
    stream = sys.stderr if stream is None else stream
    env = read_terminal_environment(environ)
    if env.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return False
    if env.get("TERM", "") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except (OSError, ValueError):  # a closed or detached stream
        return False


def _rich_progress() -> Any:
    """``rich.progress`` and ``rich.console``, or None where rich is not installed."""
    try:
        import rich.console
        import rich.progress
    except ImportError:
        return None
    return rich


class Progress:
    """One progress bar for one long run, a context manager.

    ``update(completed, total, description)`` moves it; ``note(line)`` writes a line that stays
    (above the bar on a terminal, a plain line in a log); ``close()`` removes the bar (idempotent,
    also on ``__exit__``). Off a terminal (:func:`wanted` is False) ``update`` draws nothing. A bar
    opened while another is open in this process draws nothing and notes through the outer one.

    ``enabled`` overrides :func:`wanted` (tests); ``use_rich=False`` forces the plain bar;
    ``transient=True`` leaves no trace of the bar on the terminal once closed.
    """

    def __init__(self, description: str, total: float | None = None, *, stream: TextIO | None = None,
                 enabled: bool | None = None, use_rich: bool | None = None, transient: bool = False) -> None:
        if total is not None and total < 0:
            raise ValueError(f"Progress total={total!r} must be >= 0 (or None when unknown)")
        self.stream = sys.stderr if stream is None else stream
        self.enabled = wanted(self.stream) if enabled is None else bool(enabled)
        self.description = description
        self.total = total
        self.completed = 0.0
        self.closed = False
        self._rich = None
        self._task = None
        self._plain_len = 0
        self._drawn_at = 0.0
        self._transient = transient
        self._outer: Progress | None = None
        with _open_lock:
            if _open:
                self._outer = _open[0]
            _open.append(self)
        if self._outer is not None:
            self.enabled = False
        if not self.enabled:
            return
        rich = _rich_progress() if use_rich is not False else None
        if use_rich and rich is None:
            raise ImportError(f"Progress(use_rich=True) needs rich: pip install {RICH_EXTRA}")
        if rich is not None:
            console = rich.console.Console(file=self.stream, force_terminal=True, force_interactive=True)
            columns = [rich.progress.TextColumn("{task.description}"), rich.progress.BarColumn(),
                       rich.progress.TaskProgressColumn(), rich.progress.MofNCompleteColumn(),
                       rich.progress.TimeElapsedColumn()]
            # auto_refresh=False: no refresh thread; redraws happen in update(). No stdout/stderr
            # redirection: the stream is not ours to replace (notes go through the console).
            self._rich = rich.progress.Progress(*columns, console=console, auto_refresh=False,
                                                redirect_stdout=False, redirect_stderr=False, transient=transient)
            self._rich.start()
            self._task = self._rich.add_task(description, total=total)
            self._rich.refresh()
        else:
            self._draw_plain(force=True)

    # ------------------------------------------------------------------ API
    def update(self, completed: float | None = None, total: float | None = None,
               description: str | None = None, *, advance: float = 0) -> None:
        """Set (or ``advance``) the completed count, the total, the description; redraw."""
        if self.closed:
            return
        if total is not None:
            self.total = total
        if completed is not None:
            self.completed = float(completed)
        self.completed += advance
        if description is not None:
            self.description = description
        if not self.enabled:
            return
        # Redraw at most every _MIN_INTERVAL_S (the planner reports hundreds of candidates a second),
        # but always for a new total or the last item.
        force = total is not None or (self.total is not None and self.completed >= self.total)
        if self._rich is not None:
            self._rich.update(self._task, completed=self.completed, total=self.total, description=self.description)
            if force or self._due():
                self._rich.refresh()
        else:
            self._draw_plain(force=force)

    def note(self, message: str) -> None:
        """A line that stays: above the bar on a terminal, one plain line in a log."""
        if self._outer is not None and not self._outer.closed:
            self._outer.note(message)
            return
        if self._rich is not None and not self.closed:
            self._rich.console.print(message, markup=False, highlight=False, soft_wrap=True)
            return
        if self.enabled and self._plain_len and not self.closed:
            self.stream.write("\r" + " " * self._plain_len + "\r")
            self.stream.write(message + "\n")
            self._plain_len = 0
            self._draw_plain(force=True)
        else:
            self.stream.write(message + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Remove the bar (a finished bar stays unless ``transient``). Idempotent."""
        if self.closed:
            return
        self.closed = True
        with _open_lock:
            if self in _open:
                _open.remove(self)
        if self._rich is not None:
            self._rich.stop()
        elif self.enabled and self._plain_len:
            if self._transient:
                self.stream.write("\r" + " " * self._plain_len + "\r")
            else:
                self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ plain bar
    def _due(self) -> bool:
        now = time.monotonic()
        if now - self._drawn_at < _MIN_INTERVAL_S:
            return False
        self._drawn_at = now
        return True

    def _draw_plain(self, force: bool = False) -> None:
        if not self._due() and not force:
            return
        if self.total:
            filled = min(_PLAIN_WIDTH, int(_PLAIN_WIDTH * self.completed / self.total))
            line = f"{self.description} [{'#' * filled}{'.' * (_PLAIN_WIDTH - filled)}] " \
                   f"{self.completed:g}/{self.total:g}"
        else:
            line = f"{self.description} {self.completed:g}"
        self.stream.write("\r" + line.ljust(self._plain_len))
        self.stream.flush()
        self._plain_len = len(line)
