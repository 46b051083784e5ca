"""tests/helpers.py: a hung worker's failure carries every thread's stack, so a hang seen once in CI says where."""

from __future__ import annotations

import sys

import pytest

from helpers import run_workers

HANGS = '''
import threading
import time


def blocked_in_a_helper_thread():
    time.sleep(60)


t = threading.Thread(target=blocked_in_a_helper_thread, name="stuck-helper", daemon=True)
t.start()
t.join()
'''


def test_a_worker_past_the_timeout_is_aborted_with_its_threads_stacks_in_the_error(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    logs = [tmp_path / "rank0.log"]
    with pytest.raises(TimeoutError) as info:
        run_workers([[sys.executable, str(script)]], [{}], logs, timeout=3)
    text = str(info.value)
    assert "still running after 3 s (a hang)" in text
    assert "in blocked_in_a_helper_thread" in text  # the helper thread's stack
    assert "hangs.py\", line 12 in <module>" in text  # and the main thread's, at t.join()
