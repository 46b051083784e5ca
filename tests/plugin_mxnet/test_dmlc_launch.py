"""Gluon's ``Trainer(kvstore="dist_commsched")`` under a plain dmlc-style launch equals plain dist_sync.

The processes are started here as dmlc's ``tools/launch.py --launcher local`` starts them:
the scheduler, one server and two workers each run the same script (dmlc_train.py) with
only ``DMLC_ROLE``, ``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``, ``DMLC_NUM_WORKER`` and
``DMLC_NUM_SERVER`` set by hand: no ``DMLC_NODE_HOST``, no ``DMLC_INTERFACE``, no
``commsched launch``. The script never closes the store; every process must exit by itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy
import pytest
from helpers import free_port, worker_env

pytest.importorskip("mxnet")

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "dmlc_train.py"
STEPS = 5
PIECES_PER_STEP = 19  # 6 parameters cut into pieces of at most 1 KiB (as test_equivalence.py)
CREDIT = 2048
JOB_S = 120.0


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # each in its own session: its group, by its pid
    for p in procs:
        p.wait(timeout=10)


def dmlc_job(kvstore: str, out: Path, extra_env: dict[str, str] | None = None) -> dict:
    """Scheduler, server and 2 workers of ``dmlc_train.py``; returns each role's exit status and output."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    tag = uuid.uuid4().hex
    base = {k: v for k, v in worker_env().items() if not k.startswith(("DMLC_", "COMMSCHED_"))}
    base.update({"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port), "DMLC_NUM_WORKER": "2",
                 "DMLC_NUM_SERVER": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                 "COMMSCHED_TEST_JOB": tag, **(extra_env or {})})
    roles = ["scheduler", "server", "worker", "worker"]
    procs, logs = [], []
    try:
        for i, role in enumerate(roles):
            log = open(out / f"{role}{i}.log", "w+")
            logs.append(log)
            env = dict(base, DMLC_ROLE=role, DATA_SHARD=str(i))  # each worker its own data
            procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "--kvstore", kvstore, "--out", str(out),
                                           "--steps", str(STEPS)], env=env,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + JOB_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        hung = [f"{r} (pid {p.pid})" for r, p in zip(roles, procs, strict=True) if p.poll() is None]
    finally:
        _stop(procs)
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    from commsched.bench.procs import pids_with_env

    stray = pids_with_env("COMMSCHED_TEST_JOB", tag)
    for pid in stray:
        os.kill(pid, signal.SIGKILL)
    return {"codes": [p.returncode for p in procs], "hung": hung, "roles": roles, "outputs": outputs,
            "stray": stray}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dmlc")
    settings = {"COMMSCHED_PARTITION_BYTES": "1024", "COMMSCHED_CREDIT_BYTES": str(CREDIT),
                "COMMSCHED_TIMEOUT_S": "60"}
    return {"dist_sync": dmlc_job("dist_sync", folder / "plain"),
            "dist_commsched": dmlc_job("dist_commsched", folder / "commsched", settings),
            "folders": {"dist_sync": folder / "plain", "dist_commsched": folder / "commsched"}}


def _check_clean(job: dict) -> None:
    assert job["hung"] == [], f"still running after {JOB_S} s: {job['hung']}\n" + "\n".join(
        o[-2000:] for o in job["outputs"])
    for role, code, output in zip(job["roles"], job["codes"], job["outputs"], strict=True):
        assert code == 0, f"the {role} exited with {code}:\n{output[-3000:]}"
    assert job["stray"] == [], f"processes left running: {job['stray']}"


@pytest.mark.timeout(2 * JOB_S + 60)
@pytest.mark.parametrize("kvstore", ["dist_sync", "dist_commsched"])
def test_every_process_of_a_plain_dmlc_launch_exits_by_itself(runs, kvstore):
    _check_clean(runs[kvstore])


@pytest.mark.timeout(2 * JOB_S + 60)
def test_trainer_with_kvstore_dist_commsched_equals_plain_dist_sync_bitwise(runs):
    _check_clean(runs["dist_sync"])
    _check_clean(runs["dist_commsched"])
    import json

    for rank in (0, 1):
        ref = numpy.load(runs["folders"]["dist_sync"] / f"rank{rank}.npz")
        got = numpy.load(runs["folders"]["dist_commsched"] / f"rank{rank}.npz")
        assert len(ref.files) == len(got.files) == 6
        for name in ref.files:
            assert numpy.array_equal(ref[name], got[name]), f"rank {rank} {name}: differs from plain dist_sync"
        info = json.loads((runs["folders"]["dist_commsched"] / f"rank{rank}.json").read_text())
        assert info["kvstore_type"] == "Dist_Commsched", info  # Gluon kept commsched's store
        # the settings came from COMMSCHED_*: every weight split, the credit held
        assert info["partition_bytes"] == 1024 and info["credit_bytes"] == CREDIT, info
        assert info["pieces"] == STEPS * PIECES_PER_STEP, info
        assert 0 < info["max_in_flight_bytes"] <= CREDIT, info
    # the two workers trained one model, not two
    w0 = numpy.load(runs["folders"]["dist_commsched"] / "rank0.npz")
    w1 = numpy.load(runs["folders"]["dist_commsched"] / "rank1.npz")
    assert all(numpy.array_equal(w0[n], w1[n]) for n in w0.files)


@pytest.mark.timeout(2 * JOB_S + 60)
def test_the_report_of_a_dmlc_launched_store_states_its_measurements(runs):
    import json

    _check_clean(runs["dist_commsched"])
    for rank in (0, 1):
        info = json.loads((runs["folders"]["dist_commsched"] / f"rank{rank}.json").read_text())
        numbers, text = info["numbers"], info["report"]
        assert numbers["steps"] == STEPS
        assert numbers["pieces_per_step"] == PIECES_PER_STEP
        assert numbers["bytes_per_step"] == 4 * (48 * 32 + 48 + 40 * 48 + 40 + 10 * 40 + 10)
        assert numbers["gate_mode"] == "engine"
        assert numbers["first_layer_wait_s"] is not None and numbers["first_layer_wait_s"] >= 0
        assert numbers["tail_s"] >= numbers["first_layer_wait_s"]
        assert numbers["comm_busy_s"] > 0 and numbers["payload_bandwidth_bytes_s"] > 0
        assert "ordering=dynamic" in text and "partition_bytes=1024" in text
        assert "not measurable" in text  # the forward's own ops are not visible to a KVStore: said so
