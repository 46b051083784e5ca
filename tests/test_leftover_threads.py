"""tests/conftest.py: a non-daemon thread left running fails the run by name instead of holding pytest open."""

from __future__ import annotations

import shutil
import subprocess
import sys

from helpers import REPO

LEAKY = '''
import threading

stop = threading.Event()


def test_leaves_a_thread_behind():
    threading.Thread(target=stop.wait, name="forgotten-waiter", daemon=False).start()
'''

ENDING = '''
import threading
import time


def test_leaves_a_thread_that_ends_soon():
    threading.Thread(target=time.sleep, args=(0.3,), name="ends-soon", daemon=False).start()
'''

FORGOTTEN = '''
import threading

from commsched.lifecycle import close_at_exit


class Forgotten:  # as a scheduler a test did not close: its non-daemon thread ends at close()
    def __init__(self):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.stop.wait, name="closed-at-exit", daemon=False)
        self.thread.start()
        close_at_exit(self, 5.0)

    def close(self, timeout=None):
        self.stop.set()
        self.thread.join(timeout)


kept = []


def test_forgets_to_close():
    kept.append(Forgotten())
'''


def run_suite(tmp_path, body):
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_x.py").write_text(body)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's settings (its timeout plugin and paths)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "-c", str(tmp_path / "pytest.ini"), str(tmp_path / "test_x.py")],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "COMMSCHED_TEST_LEFTOVER_GRACE_S": "1"})


def test_a_thread_left_running_fails_the_run_by_name_and_the_process_exits(tmp_path):
    proc = run_suite(tmp_path, LEAKY)  # without the guard this would time out: the thread never ends
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
    assert "non-daemon threads still alive" in proc.stdout and "forgotten-waiter" in proc.stdout


def test_a_thread_that_ends_within_the_grace_is_no_failure(tmp_path):
    proc = run_suite(tmp_path, ENDING)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "still alive" not in proc.stdout


def test_what_close_at_exit_would_close_is_closed_first_and_is_no_failure(tmp_path):
    proc = run_suite(tmp_path, FORGOTTEN)  # interpreter exit closes it too (docs/ARCHITECTURE.md)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "still alive" not in proc.stdout
