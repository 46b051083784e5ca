"""Synthetic phase results of the bench runner, for report arithmetic without a framework.

Import it as ``bench_phases`` (``tests/`` is on ``sys.path``): tests/bench/test_report.py
and tests/bench/test_rounds.py build their phases from these.
"""

from __future__ import annotations

__all__ = ["CONFIG", "DDP", "HVD", "baseline_rank", "cpu", "train_rank"]

CONFIG = {"workload": "tiny", "workers": 2, "nodes": 2, "bandwidth": "1gbit",
          "intra_bandwidth": None, "strategies": [], "steps": 4, "warmup": 1,
          "baseline_steps": 3, "batch_size": 8, "partition_bytes": 1, "credit_bytes": 1,
          "network": "netns", "seed": 0, "extra": {}}


def cpu(busy=0.5):
    return {"cpu_busy": busy, "process_cpu_s": 1.0, "wall_s": 2.0}


def baseline_rank(rank):
    return {
        "rank": rank, "param_bytes": 1000, "num_params": 250, "layers": [],
        "forward_s": [0.2] * 3, "backward_s": [0.4] * 3, "optimizer_s": [0.05] * 3,
        "one_worker_s": [0.6] * 3, "comm_s": [0.5] * 3, "comm_cpu": cpu(),
        "forward_under_comm_s": [0.25] * 3, "backward_under_comm_s": [0.45] * 3,
        "optimizer_under_comm_s": [0.05] * 3, "under_comm_span_s": [[0.75, 0.5]] * 3,
    }


def train_rank(steps, method, bubbles=None, backward=None, step_call=None, checksum="a"):
    return {
        "step_times_s": steps, "total_s": sum(steps), "forward_s": [0.2] * len(steps),
        "backward_s": backward or [0.4] * len(steps),
        "step_call_s": step_call or [0.05] * len(steps),
        "bubble_s": bubbles, "bubble_method": method, "cpu": cpu(0.95),
        "checksum": checksum, "stats": {}, "timeline": [],
    }


DDP = "backward() under DDP minus ..."
HVD = "step() under Horovod minus ..."
