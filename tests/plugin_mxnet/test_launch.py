"""``commsched launch mxnet``: environment, exit status, and no process left behind.

The worker commands here are tiny shell commands; the scheduler and server are
real MXNet processes that would wait forever for workers that never connect, so
every test also proves the launcher ends them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

pytest.importorskip("mxnet")


def test_workers_get_the_ps_lite_variables_for_loopback(job, tmp_path):
    out = tmp_path / "env"
    out.mkdir()
    script = f'env | grep ^DMLC_ > {out}/$$.txt'
    run = job(command=["sh", "-c", script], workers=2, servers=1, grace=1, timeout=45)
    assert run.returncode == 0, run.output
    assert run.stray == []
    files = list(out.glob("*.txt"))
    assert len(files) == 2
    for path in files:
        env = dict(line.split("=", 1) for line in path.read_text().split())
        assert env["DMLC_ROLE"] == "worker"
        assert env["DMLC_NODE_HOST"] == "127.0.0.1" and env["DMLC_INTERFACE"] == "lo"
        assert env["DMLC_PS_ROOT_URI"] == "127.0.0.1" and int(env["DMLC_PS_ROOT_PORT"]) > 0
        assert env["DMLC_NUM_WORKER"] == "2" and env["DMLC_NUM_SERVER"] == "1"


def test_a_failing_worker_command_stops_the_job_and_returns_its_status(job):
    run = job(command=["sh", "-c", "exit 7"], grace=2, timeout=45)
    assert run.returncode == 7
    assert "exited with status 7" in run.output
    assert run.stray == [], "scheduler or server left running"


def test_the_job_timeout_stops_everything(job):
    run = job(command=["sleep", "60"], timeout=40, job_timeout=3)
    assert run.returncode == 124
    assert "--timeout" in run.output
    assert run.stray == []


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupting_the_launcher_stops_every_process(sig, status, find_tagged):
    tag = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "commsched", "launch", "mxnet", "--workers", "2", "--", "sleep", "60"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, COMMSCHED_TEST_JOB=tag), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while len(find_tagged(tag)) < 5:  # launcher, scheduler, server, 2 workers
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.1)
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == status, output
    assert "stopping the job" in output
    left = find_tagged(tag)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []


def test_a_missing_worker_command_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "commsched", "launch", "mxnet", "--workers", "2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "put it after '--'" in proc.stderr


@pytest.mark.parametrize("option, value, expected", [
    ("--workers", "0", "count >= 1"), ("--workers", "two", "count >= 1"), ("--servers", "-1", "count >= 1"),
    ("--port", "70000", "port 0..65535"), ("--timeout", "-5", "positive number of seconds"),
    ("--timeout", "nan", "positive number of seconds"), ("--grace", "-1", "number of seconds >= 0")])
def test_bad_counts_ports_and_seconds_are_usage_errors_naming_the_option_before_any_process_starts(
        option, value, expected, capsys, monkeypatch):
    from commsched import cli
    from commsched.plugins.mxnet import launch

    monkeypatch.setattr(launch, "Job", None)  # a job that started would fail with TypeError, not a usage error
    with pytest.raises(SystemExit) as exc_info:
        cli.main(["launch", "mxnet", option, value, "--", "sleep", "60"])
    assert exc_info.value.code == 2
    assert f"argument {option}: invalid {expected} value: '{value}'" in capsys.readouterr().err
