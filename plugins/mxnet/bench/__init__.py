"""``commsched bench --framework mxnet``: the framework parts of the benchmark.

Same file names in every plugin: :mod:`.strategies` (what each strategy is and
how its job starts; ``add_arguments``/``run``), :mod:`.worker` (one process of
the job), :mod:`.workloads` (the model). The harness, the report and the table
are framework-free, in :mod:`commsched.bench`.
"""

from commsched.plugins.mxnet.bench.strategies import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
