"""Framework-free parts of ``commsched bench``.

- :mod:`commsched.bench.netns`: an emulated cluster on one machine (network
  namespaces, a bridge, ``tc tbf`` per link) or its loopback stand-in;
- :mod:`commsched.bench.procs`: worker processes with deadlines, signals
  turned into exceptions so teardown always runs;
- :mod:`commsched.bench.cpu`: machine-wide CPU busy fraction.

The workloads, the worker and the report need PyTorch and live in
``commsched.plugins.torch.bench``.
"""
