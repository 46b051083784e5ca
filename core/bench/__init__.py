"""Framework-free parts of ``commsched bench`` (docs/bench.md).

- :mod:`commsched.bench.cli`: the ``bench`` flags and runs (``--framework
  torch``), and the loop the MLP benchmarks share (``tensorflow``, ``mxnet``);
- :mod:`commsched.bench.runner`: one phase per strategy, worker processes of a
  plugin's ``bench.worker`` module; :mod:`commsched.bench.spec`: ``--strategies``;
- :mod:`commsched.bench.report`: the one report schema and table of every framework;
- :mod:`commsched.bench.netns`: an emulated cluster on one machine (network
  namespaces, a bridge, ``tc tbf`` per link) or its loopback stand-in;
- :mod:`commsched.bench.procs`: worker processes with deadlines, signals
  turned into exceptions so teardown always runs, free ports, Horovod rendezvous;
- :mod:`commsched.bench.cpu`: machine-wide CPU busy fraction;
  :mod:`commsched.bench.options`: the MLP benchmarks' flags.

The framework parts live in each plugin under the same names:
``commsched.plugins.<framework>.bench.{strategies,worker,workloads}``.
"""
