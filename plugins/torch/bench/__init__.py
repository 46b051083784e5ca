"""``commsched bench`` on PyTorch: workloads, the worker process, runner, report.

Entry points: :func:`commsched.plugins.torch.bench.cli.add_arguments` and
:func:`commsched.plugins.torch.bench.cli.run` (registered by ``commsched``'s
CLI as the ``bench`` subcommand), or ``python -m commsched.plugins.torch.bench``.
The network emulation itself is framework-free: :mod:`commsched.bench.netns`.
"""
