"""``commsched bench --framework torch``: the framework parts of the benchmark.

Same file names in every plugin: :mod:`.strategies` (DDP, Horovod, commsched
orderings; which cannot run here), :mod:`.worker` (one rank's process),
:mod:`.workloads` (the models). The CLI, the runner, the report and the
strategy parser are framework-free, in :mod:`commsched.bench`
(:mod:`commsched.bench.cli` is what ``commsched bench`` runs);
``python -m commsched.plugins.torch.bench`` runs it alone.
"""
