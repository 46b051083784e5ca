"""examples/mxnet_train.py runs under the launcher, configured from COMMSCHED_* variables."""

from __future__ import annotations

import re
import sys

import pytest

pytest.importorskip("mxnet")


@pytest.mark.timeout(90)
def test_the_example_trains_with_mx_kv_create_commsched(job):
    run = job(command=[sys.executable, "examples/mxnet_train.py", "--steps", "12", "--hidden", "64"],
              env={"COMMSCHED_PARTITION_BYTES": "8KiB", "COMMSCHED_CREDIT_BYTES": "32KiB"}, timeout=75)
    assert run.returncode == 0, run.output[-3000:]
    assert run.stray == []
    summary = re.search(r"commsched: 2 workers, median step [\d.]+ ms, loss ([\d.]+) -> ([\d.]+)", run.output)
    assert summary, run.output[-3000:]
    assert float(summary.group(2)) < float(summary.group(1))  # it learns
