"""The installed package and the dev environment (make venv / make horovod).

Each check runs in a subprocess whose cwd is a temporary folder and whose
PYTHONPATH is cleared, so the repo root is not on sys.path: what imports there
is what the installed package (or the venv) provides, not the source folders.
"""
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _expected_version():
    text = (REPO / "core" / "_version.py").read_text(encoding="utf-8")
    return re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.MULTILINE).group(1)


def _env():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def run_py(code, cwd, timeout=120):
    """Run ``code`` in a fresh interpreter of this venv, outside the repo."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout,
    )


def _ok(proc):
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def _installed(dist):
    from importlib import metadata

    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def test_import_commsched_and_version(tmp_path):
    out = _ok(run_py(
        """
        import commsched
        print(commsched.__version__)
        print(commsched.__file__)
        """,
        tmp_path,
    ))
    version, location = out.split()[:2]
    assert version == _expected_version()
    # The package is the core/ folder (editable) or a copy in site-packages.
    assert Path(location).name == "__init__.py"


def test_distribution_metadata_matches_version(tmp_path):
    out = _ok(run_py("from importlib import metadata; print(metadata.version('commsched'))", tmp_path))
    assert out.strip() == _expected_version()


def test_plugins_are_subpackage(tmp_path):
    out = _ok(run_py(
        """
        import importlib.util
        spec = importlib.util.find_spec("commsched.plugins")
        assert spec is not None, "commsched.plugins not found"
        print(list(spec.submodule_search_locations or []))
        """,
        tmp_path,
    ))
    assert out.strip() != "[]"


@pytest.mark.skipif(not (REPO / "plugins" / "torch" / "__init__.py").exists(),
                    reason="plugins/torch not written yet")
def test_torch_plugin_importable(tmp_path):
    _ok(run_py("import commsched.plugins.torch", tmp_path))


@pytest.mark.parametrize("name", ["core", "plugins"])
def test_source_folders_are_not_top_level_modules(tmp_path, name):
    out = _ok(run_py(
        f"""
        import importlib.util, sys
        assert not any(p in ("", ".") for p in sys.path[1:]), sys.path
        spec = importlib.util.find_spec({name!r})
        print(spec.origin if spec else None, list(spec.submodule_search_locations or []) if spec else "")
        """,
        tmp_path,
    ))
    assert out.split()[0] == "None", f"{name!r} is importable at top level: {out}"


def test_console_script_version(tmp_path):
    exe = BIN / "commsched"
    if not exe.exists():
        found = shutil.which("commsched")
        assert found, "console script 'commsched' is not installed"
        exe = Path(found)
    proc = subprocess.run([str(exe), "--version"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=60)
    _ok(proc)
    assert _expected_version() in proc.stdout + proc.stderr


def test_frameworks_import_in_one_process(tmp_path):
    """torch, TF 2.21 and mxnet 1.9.1 (with the numpy.bool shim) coexist."""
    missing = [d for d in ("torch", "tensorflow-cpu", "mxnet") if not _installed(d)]
    if missing:
        pytest.skip(f"not installed: {missing}")
    out = _ok(run_py(
        """
        import sys
        assert "numpy" not in sys.modules, "the shim must not import numpy at startup"
        import torch, tensorflow as tf, mxnet as mx, numpy as np
        assert mx.nd.array([1, 2, 3]).sum().asscalar() == 6
        print(torch.__version__, tf.__version__, mx.__version__, np.__version__)
        """,
        tmp_path, timeout=180,
    ))
    assert "2.13.0" in out and "2.21.0" in out and "1.9.1" in out


def _horovod_skip():
    if not _installed("horovod"):
        pytest.skip("horovod not installed (make horovod)")


def test_horovod_torch_allreduce_two_ranks(tmp_path):
    _horovod_skip()
    horovodrun = BIN / "horovodrun"
    assert horovodrun.exists(), "horovodrun missing from the venv"
    script = tmp_path / "hvd_allreduce.py"
    script.write_text(textwrap.dedent(
        """
        import torch
        import horovod.torch as hvd
        hvd.init()
        t = torch.full((4,), float(hvd.rank() + 1))
        out = hvd.allreduce(t, op=hvd.Sum, name="x")
        assert out.tolist() == [3.0] * 4, out
        print(f"rank {hvd.rank()}/{hvd.size()} ok", flush=True)
        hvd.shutdown()
        """
    ))
    proc = subprocess.run(
        [str(horovodrun), "-np", "2", "-H", "localhost:2", "--gloo",
         "--network-interface", "lo", sys.executable, str(script)],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240,
    )
    _ok(proc)
    assert "rank 0/2 ok" in proc.stdout and "rank 1/2 ok" in proc.stdout, proc.stdout


@pytest.mark.parametrize("framework,code", [
    ("tensorflow", """
        import tensorflow as tf
        import horovod.tensorflow as hvd
        hvd.init()
        assert float(tf.reduce_sum(hvd.allreduce(tf.ones(3), op=hvd.Sum))) == 3.0
        hvd.shutdown()
        print("ok")
    """),
    ("mxnet", """
        import mxnet as mx
        import horovod.mxnet as hvd
        hvd.init()
        assert hvd.allreduce(mx.nd.ones(3), average=False).sum().asscalar() == 3.0
        hvd.shutdown()
        print("ok")
    """),
])
def test_horovod_other_frameworks_built(tmp_path, framework, code):
    """build_horovod.sh builds TF/MXNet support wherever they import."""
    _horovod_skip()
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} not installed")
    _ok(run_py(code, tmp_path, timeout=180))


# ------------------------------------------------------------ the built wheel
# Built once per session with `python -m build --wheel --no-isolation` from a copy of
# the source (so no build/ or *.egg-info lands in the repo), installed with --no-deps
# into a fresh venv that has no framework: what a user gets from `pip install commsched`.
_SOURCES = ["setup.py", "pyproject.toml", "README.md", "core", "plugins"]


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    if importlib.util.find_spec("build") is None:
        pytest.skip("the 'build' package is not installed (requirements/tools.txt)")
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in _SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    _ok(subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(root / "dist"),
                        str(src)], cwd=root, env=_env(), capture_output=True, text=True, timeout=300))
    wheels = list((root / "dist").glob("commsched-*.whl"))
    assert len(wheels) == 1, wheels
    venv = root / "venv"
    _ok(subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True,
                       timeout=120))
    _ok(subprocess.run([str(BIN / "pip"), "--python", str(venv / "bin" / "python"), "install", "--no-deps",
                        "--no-index", "-q", str(wheels[0])], cwd=root, env=_env(), capture_output=True, text=True,
                       timeout=300))
    return wheels[0], venv


def _in_venv(venv, code, cwd):
    return subprocess.run([str(venv / "bin" / "python"), "-c", textwrap.dedent(code)], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=120)


def test_wheel_metadata_names_version_extras_and_console_script(wheel_venv):
    import zipfile

    wheel, _ = wheel_venv
    assert wheel.name.startswith(f"commsched-{_expected_version()}-py3-none-any")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "Name: commsched" in meta and f"Version: {_expected_version()}" in meta
    for extra in ("torch", "tensorflow", "mxnet", "horovod", "progress"):
        assert f"Provides-Extra: {extra}" in meta
    assert 'torch==2.13.0; extra == "torch"' in meta
    assert 'rich==15.0.0; extra == "progress"' in meta  # the bars' library is an extra, never required
    assert not [line for line in meta.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert "commsched = commsched.cli:main" in entry
    assert not any(n.startswith(("core/", "plugins/", "tests/")) for n in names)
    assert "commsched/plugins/torch/optimizer.py" in names


def test_wheel_imports_without_any_framework_and_reports_its_version(wheel_venv, tmp_path):
    _, venv = wheel_venv
    out = _ok(_in_venv(venv, """
        import importlib.util, sys
        for framework in ("torch", "tensorflow", "mxnet", "numpy", "rich"):
            assert importlib.util.find_spec(framework) is None, framework + " is installed in the fresh venv"
        import commsched
        import commsched.progress, commsched.tuner, commsched.bench.runner  # the plain bar without rich
        print(commsched.__version__, commsched.__file__)
    """, tmp_path))
    version, location = out.split()
    assert version == _expected_version()
    assert str(venv) in location  # the installed copy, not the repo's core/
    proc = subprocess.run([str(venv / "bin" / "commsched"), "--version"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert _expected_version() in _ok(proc)


@pytest.mark.parametrize("extra", ["torch", "tensorflow", "mxnet"])
def test_wheel_plugin_without_framework_says_which_extra(wheel_venv, tmp_path, extra):
    _, venv = wheel_venv
    proc = _in_venv(venv, f"import commsched.plugins.{extra}", tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError") and f"pip install commsched[{extra}]" in last, proc.stderr[-2000:]
