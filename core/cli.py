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

# subcommand -> (module providing add_arguments/run, one-line help)
SUBCOMMANDS = {
    "bench": ("commsched.plugins.torch.bench.cli",
              "emulated-cluster benchmark: commsched vs DDP and Horovod (needs torch)"),
    "demo": ("commsched.plugins.torch.demo",
             "the demo job: 2 gloo workers training with the scheduler (needs torch)"),
    "launch": ("commsched.plugins.mxnet.launch",
               "start an MXNet parameter-server job on this machine (needs mxnet)"),
}


def _load(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SystemExit(f"commsched: this subcommand needs {module} ({exc}); install the framework extra, "
                         "e.g. pip install 'commsched[torch]', or run `make venv` in the repository") from exc


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
            loaded = _load(module)
            loaded.add_arguments(sub_parser)
            sub_parser.set_defaults(_run=loaded.run)
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 0 if args.command is None else 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
