"""The ``commsched`` command line.

Subcommands that need a framework live in that framework's plugin and are loaded
only when called, so ``commsched --version`` works with no framework installed.
Each such module provides ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from commsched._version import __version__

__all__ = ["main"]

# `commsched bench --framework X` -> the module that benchmarks framework X
# (torch's workload benchmark is framework-free code that loads the plugin's parts when it runs)
BENCH_FRAMEWORKS = {
    "torch": "commsched.bench.cli",
    "tensorflow": "commsched.plugins.tensorflow.bench",
    "mxnet": "commsched.plugins.mxnet.bench",
}

# subcommand -> (module providing add_arguments/run, or "module:verb" providing add_<verb>_arguments/run_<verb>,
# one-line help)
SUBCOMMANDS = {
    "bench": ("commsched.bench.cli",
              "emulated-cluster benchmark of commsched against the framework's stock strategy "
              "(--framework torch|tensorflow|mxnet, default torch; needs that framework)"),
    "demo": ("commsched.plugins.torch.demo",
             "the quick benchmark (make demo): 2 workers, 1 Gbit/s, DDP vs commsched dynamic (needs torch)"),
    "launch": ("commsched.plugins.mxnet.launch",
               "start an MXNet parameter-server job on this machine (needs mxnet)"),
    "simulate": ("commsched.costmodel.cli:simulate",
                 "predict `commsched bench` (--workload) or a zoo model on a described cluster (--model, --cluster) "
                 "with the cost model; writes the bench report schema with \"predicted\": true"),
    "validate": ("commsched.costmodel.cli:validate",
                 "run a grid of `commsched bench` configurations and the simulator on each; report errors and "
                 "Kendall tau (needs torch, root)"),
    "plan": ("commsched.costmodel.plan_cli:plan",
             "search the communication plan (order, piece sizes, fusion, credit, algorithm per piece) of a model "
             "on a topology with the simulator and a MILP; writes the plan ordering='planned' executes"),
    "advise": ("commsched.costmodel.cli:advise",
               "will scheduling help this model on this network? expected speedup over DDP, settings, why"),
    "profile": ("commsched.plugins.torch.profiler",
                "per-layer profile of a benchmark workload as `commsched bench` runs it, for the simulator "
                "(needs torch)"),
    "probe": ("commsched.plugins.torch.probe",
              "measure the emulated cluster's links (gloo sweeps 4 KiB - 64 MiB) and fit alpha/beta per link "
              "class into a topology (needs torch)"),
}


def _load(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SystemExit(f"commsched: this subcommand needs {module} ({exc}); install the framework extra, "
                         "e.g. pip install 'commsched[torch]', or run `make venv` in the repository") from exc


def _bench_framework(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--framework" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--framework="):
            return arg.split("=", 1)[1]
    return "torch"


def main(argv: list[str] | None = None) -> int:
    """Run the ``commsched`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="commsched",
                                     description="Communication scheduler for data-parallel training.")
    parser.add_argument("--version", action="version", version=f"commsched {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text)
        if name == chosen:  # import only the framework this call needs
            if name == "bench":
                framework = _bench_framework(argv)
                if framework not in BENCH_FRAMEWORKS:
                    parser.error(f"--framework {framework!r} is not known; use one of {', '.join(BENCH_FRAMEWORKS)}")
                module = BENCH_FRAMEWORKS[framework]
                sub_parser.add_argument("--framework", choices=list(BENCH_FRAMEWORKS), default="torch",
                                        help="which framework's benchmark to run (default torch)")
            module, _, verb = module.partition(":")  # "module:verb": add_<verb>_arguments / run_<verb>
            loaded = _load(module)
            getattr(loaded, f"add_{verb}_arguments" if verb else "add_arguments")(sub_parser)
            sub_parser.set_defaults(_run=getattr(loaded, f"run_{verb}" if verb else "run"))
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 0 if args.command is None else 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
