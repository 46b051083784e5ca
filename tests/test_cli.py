"""The commsched command: version, and `bench --framework` routing to each plugin's benchmark."""

from __future__ import annotations

import pytest

from commsched.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert "commsched" in capsys.readouterr().out


@pytest.mark.parametrize("framework, own_flag",
                         [("torch", "--workload"), ("mxnet", "--hidden"), ("tensorflow", "--unroll")])
def test_bench_framework_selects_that_plugins_benchmark(capsys, framework, own_flag):
    with pytest.raises(SystemExit):
        main(["bench", "--framework", framework, "--help"])
    out = capsys.readouterr().out
    assert own_flag in out and "--framework" in out


def test_bench_default_is_torch(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "--workload" in capsys.readouterr().out


def test_unknown_framework_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--framework", "jax", "--json", "x.json"])
    assert exc.value.code == 2
    assert "'jax' is not known" in capsys.readouterr().err


def test_help_says_bench_serves_every_framework_and_demo_is_the_quick_benchmark(capsys):
    assert main([]) == 0
    out = " ".join(capsys.readouterr().out.split())
    bench = out[out.index("bench "):out.index("demo ")]
    assert "torch|tensorflow|mxnet" in bench and "needs torch" not in bench
    demo = out[out.index("demo "):out.index("launch ")]
    assert "quick benchmark" in demo and "training" not in demo
