"""Closed optimizers leave no key in torch's rendezvous store.

Each DistributedOptimizer adds its own process group (gloo publishes one rendezvous key
per rank), order-agreement queues, and with ``ordering="auto"`` its switch decisions; a
run that creates and closes one optimizer per ordering must end with exactly the keys the
store held before the first (the default group's own).
"""

from __future__ import annotations

import pytest
from pathlib import Path


@pytest.mark.timeout(240)
def test_every_key_an_optimizer_wrote_is_gone_after_every_rank_closed_it(ranks):
    results = ranks(2, script=Path(__file__).resolve().parent / "keys_worker.py", timeout=200)
    for r in results:
        assert r["after"] == r["before"], r
        # the check can fail: while an optimizer was open its group's keys were in the store
        assert any(len(keys) > len(r["before"]) for keys in r["during"].values()), r
