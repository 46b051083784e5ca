"""Packaging for commsched.

The source folders are not named after the import name: ``core/`` is installed
as the package ``commsched`` and ``plugins/`` as ``commsched.plugins``, so users
write ``import commsched`` and ``from commsched.plugins.torch import ...``.
Neither ``core`` nor ``plugins`` becomes a top-level module.

Frameworks are extras (the core imports none):
  pip install -e '.[torch,test]'
The dev venv (make venv) installs the pinned set from requirements/ instead;
see scripts/setup_venv.sh, which also installs the mxnet/numpy shim (.pth).
"""
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent


def _version():
    text = (HERE / "core" / "_version.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.MULTILINE)
    if not match:
        raise RuntimeError("core/_version.py has no __version__ = '...' line")
    return match.group(1)


def _packages(folder, name):
    """``name`` for ``folder`` plus every subpackage under it, renamed."""
    subs = find_packages(str(HERE / folder), exclude=["tests", "tests.*", "*.tests", "*.tests.*"])
    return [name] + [f"{name}.{sub}" for sub in subs]


PACKAGES = _packages("core", "commsched") + _packages("plugins", "commsched.plugins")

TORCH = ["torch==2.13.0"]
# tf-keras==2.21.0 is not listed: its metadata requires 'tensorflow', which pulls
# the full tensorflow package beside tensorflow-cpu. Install it with
# 'pip install --no-deps tf-keras==2.21.0' (make venv does).
TENSORFLOW = ["tensorflow-cpu==2.21.0"]
# mxnet 1.9.1 needs numpy.bool on numpy 1.26: make venv installs a .pth shim.
MXNET = ["mxnet==1.9.1", "numpy==1.26.4"]
# Horovod 0.28.1 ships only an sdist that needs patches: 'make horovod' builds a
# wheel once per machine into ~/.cache/commsched/wheels/<key>/. With that wheel:
#   pip install -f ~/.cache/commsched/wheels/<key> '.[horovod]'
HOROVOD = ["horovod==0.28.1"]
# The planner's MILP solver (commsched plan); see requirements/planner.txt for why HiGHS.
PLANNER = ["highspy==1.16.0"]
# The online tuner's search (ordering="auto"); see requirements/tuner.txt for why Optuna.
TUNER = ["optuna==5.0.0"]
# Progress bars on a terminal (commsched bench/validate/plan, the tuner); see requirements/progress.txt.
PROGRESS = ["rich==15.0.0"]
TEST = ["pytest", "pytest-timeout", "hypothesis", "ruff", "matplotlib"]

setup(
    name="commsched",
    version=_version(),
    description="Communication scheduler for data-parallel training "
    "(priority, partition and credit for PyTorch, TensorFlow and MXNet)",
    long_description=(HERE / "README.md").read_text(encoding="utf-8")
    if (HERE / "README.md").exists()
    else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    package_dir={"commsched": "core", "commsched.plugins": "plugins"},
    packages=PACKAGES,
    install_requires=[],
    extras_require={
        "torch": TORCH,
        "tensorflow": TENSORFLOW,
        "mxnet": MXNET,
        "horovod": HOROVOD,
        "planner": PLANNER,
        "tuner": TUNER,
        "progress": PROGRESS,
        "test": TEST,
        # Horovod is left out of 'all': without the cached wheel pip would try
        # the unpatched sdist and fail after minutes of compiling.
        "all": TORCH + TENSORFLOW + MXNET + PLANNER + TUNER + PROGRESS + TEST,
    },
    entry_points={"console_scripts": ["commsched = commsched.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Operating System :: POSIX :: Linux",
    ],
)
