"""scripts/hvd_pairs.py: the interleaving (ABBA) and the summary, with the horovodrun runs replaced."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from helpers import REPO


def load_script():
    spec = importlib.util.spec_from_file_location("hvd_pairs", REPO / "scripts" / "hvd_pairs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pairs_run_in_abba_order_and_the_summary_reads_medians_and_pair_ratios(tmp_path, monkeypatch, capsys):
    pairs = load_script()
    speeds = {("hvd", "1"): 100.0, ("commsched", "1"): 110.0, ("commsched", "2"): 90.0, ("hvd", "2"): 100.0,
              ("hvd", "3"): 200.0, ("commsched", "3"): 210.0}
    order = []

    def fake_run(dist, args, workdir, tag):
        order.append((dist, tag))
        return speeds[(dist, tag)]

    monkeypatch.setattr(pairs, "run_one", fake_run)
    out = tmp_path / "sub" / "pairs.json"
    monkeypatch.setattr(sys, "argv", ["hvd_pairs.py", "--pairs", "3", "--json", str(out)])
    pairs.main()
    assert order == [("hvd", "1"), ("commsched", "1"), ("commsched", "2"), ("hvd", "2"), ("hvd", "3"),
                     ("commsched", "3")]
    s = json.loads(out.read_text())["summary"]
    assert s["pairs"] == 3 and s["commsched_won"] == 2
    assert s["hvd_median"] == 100.0 and s["commsched_median"] == 110.0
    assert s["ratio_of_medians"] == pytest.approx(1.1)
    assert s["median_pair_ratio"] == pytest.approx(1.05)  # ratios 1.1, 0.9, 1.05
    assert s["min_pair_ratio"] == pytest.approx(0.9) and s["max_pair_ratio"] == pytest.approx(1.1)
    assert "ratio of medians 1.100x" in capsys.readouterr().out


def test_a_failed_run_names_the_command_and_fewer_than_one_pair_is_refused(tmp_path, monkeypatch):
    pairs = load_script()
    monkeypatch.setattr(sys, "argv", ["hvd_pairs.py", "--pairs", "0"])
    with pytest.raises(SystemExit):
        pairs.main()

    class Failed:
        returncode, stdout, stderr = 3, "", "horovodrun: no such thing"

    monkeypatch.setattr(pairs.subprocess, "run", lambda *a, **k: Failed())
    args = type("A", (), {"np": 2, "num_batches_per_iter": 1, "num_iters": 1, "timeout_s": 5.0})()
    with pytest.raises(SystemExit, match=r"(?s)hvd run 1 failed \(rc 3\).*horovodrun.*no such thing"):
        pairs.run_one("hvd", args, str(tmp_path), "1")
