"""The README's example runs under torchrun and reports what the scheduler did."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cross", [True, False], ids=["cross-iteration", "synchronous"])
def test_torch_example_runs_under_torchrun(tmp_path, cross):
    out = tmp_path / "stats.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "examples" / "torch_train.py"), "--steps", "8", "--width", "128", "--json", str(out)]
    if not cross:
        cmd.append("--no-cross-iteration")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "bubble per step" in proc.stdout
    stats = json.loads(out.read_text())
    assert stats["steps"] == 8 and stats["cross_iteration"] is cross
    # 13 parameters, some split into several pieces; runs of small ones fused (fusion_bytes) into one task
    tasks = 13 - sum(len(members) - 1 for members in stats["fused"].values())
    assert stats["pieces"] >= 8 * tasks


# ------------------------------------------------- PyTorch's DDP tutorial shape, two lines changed
_EXAMPLES = ROOT / "examples"
#: what stock DDP's gloo teardown printed when it aborted at interpreter exit (seen once in CI)
_STOCK_EXIT_ABORT = "terminate called without an active exception"


def _code(path: Path) -> list[str]:
    """The script's lines after its module docstring (the docstrings say which file is which)."""
    text = path.read_text()
    body = text.split('"""', 2)[2]
    return body.splitlines()


def _changed(old: list[str], new: list[str]) -> tuple[list[str], list[str]]:
    """The removed and the added non-blank lines of ``old`` -> ``new``, stripped."""
    import difflib

    removed, added = [], []
    for line in difflib.unified_diff(old, new, lineterm="", n=0):
        if line.startswith(("---", "+++", "@@")) or not line[1:].strip():
            continue
        (removed if line[0] == "-" else added).append(line[1:].strip())
    return removed, added


def _quickstart_diff(section: str) -> tuple[list[str], list[str]]:
    """The removed and added lines of the diff block under ``## <section>`` of docs/quickstart.md."""
    text = (ROOT / "docs" / "quickstart.md").read_text()
    block = text.split(f"## {section}", 1)[1].split("```diff\n", 1)[1].split("```", 1)[0]
    lines = block.splitlines()
    return ([x[1:].strip() for x in lines if x.startswith("-") and x[1:].strip()],
            [x[1:].strip() for x in lines if x.startswith("+") and x[1:].strip()])


def test_ddp_tutorial_differs_from_its_commsched_version_by_the_documented_diff():
    removed, added = _changed(_code(_EXAMPLES / "ddp_tutorial.py"), _code(_EXAMPLES / "ddp_tutorial_commsched.py"))
    assert (removed, added) == _quickstart_diff("torchrun + DDP")
    # the two lines of the change, besides the import: DDP dropped, the optimizer wrapped
    assert [line for line in removed if not line.startswith("from ")] == [
        'model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)',
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)"]
    assert [line for line in added if not line.startswith("from ")] == [
        "optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)"]


@pytest.mark.timeout(420)
def test_ddp_tutorial_under_torchrun_checkpoint_loads_on_every_rank_and_equals_ddps(tmp_path):
    """Both scripts under torchrun on 2 CPU ranks: rank 0 saves after each epoch, every rank loads
    the checkpoint and evaluates it. The commsched checkpoint must hold the last step's update
    (state_dict applies it) and equal DDP's bitwise (2 ranks: a sum of two is exact either way, and
    /2 is exact); after loading and a forward no rank may apply its pending update again."""
    import torch

    results = {}
    for name in ("ddp_tutorial", "ddp_tutorial_commsched"):
        ckpt, out = tmp_path / f"{name}.pt", tmp_path / f"{name}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(_EXAMPLES / f"{name}.py"), "--epochs", "2", "--checkpoint", str(ckpt), "--json", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=140, cwd=tmp_path)
        for _ in range(2):
            if not (name == "ddp_tutorial" and proc.returncode != 0 and _STOCK_EXIT_ABORT in proc.stderr):
                break
            # the reference is stock DDP, no commsched: its gloo teardown aborts at exit now and then in
            # CI (SIGABRT, twice in a row once); run the reference again rather than fail commsched's check
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=140, cwd=tmp_path)
        if name == "ddp_tutorial" and proc.returncode != 0 and _STOCK_EXIT_ABORT in proc.stderr and out.exists():
            # three aborts in stock torch's teardown after rank 0 wrote the reference's result (seeded: the
            # same in every attempt); the reference is complete, use it
            proc = subprocess.CompletedProcess(cmd, 0, proc.stdout, proc.stderr)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        results[name] = (json.loads(out.read_text()), torch.load(ckpt, weights_only=True))
    (ddp, ddp_ckpt), (ours, our_ckpt) = results["ddp_tutorial"], results["ddp_tutorial_commsched"]
    for report in (ddp, ours):
        assert report["loaded"] is True and report["world"] == 2
        assert report["ranks_equal"] is True, report
    assert {f"module.{k}" for k in our_ckpt} == set(ddp_ckpt)  # the same model, without DDP's prefix
    for key, value in our_ckpt.items():
        assert torch.equal(value, ddp_ckpt[f"module.{key}"]), key
    assert ours["eval_loss"] == ddp["eval_loss"] and ours["loss"] == ddp["loss"]
