"""The core imports and runs with every framework made unimportable."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

BLOCKED = ["torch", "tensorflow", "mxnet", "horovod", "keras", "jax", "numpy"]

SCRIPT = textwrap.dedent(
    """
    import sys
    for name in %r:
        sys.modules[name] = None  # `import name` now raises ImportError

    import array, threading
    import commsched
    from commsched import Scheduler, SchedulerConfig
    from commsched.backends import ArrayOps, InProcessWorld
    import commsched.config, commsched.partition, commsched.store, commsched.timeline, commsched.errors
    # the framework-free half of `commsched bench` (the frameworks' halves live in the plugins)
    import commsched.bench.cli, commsched.bench.runner, commsched.bench.report, commsched.bench.spec
    import commsched.bench.options, commsched.bench.procs, commsched.bench.netns, commsched.bench.cpu
    import commsched.policy, commsched.protocol, commsched.state, commsched.failures, commsched.task
    import commsched.replay, commsched.stats, commsched.lifecycle, commsched.tuner
    import commsched.costmodel.profile, commsched.costmodel.topology, commsched.costmodel.collectives
    import commsched.costmodel.zoo, commsched.costmodel.simulator, commsched.costmodel.cli

    config = SchedulerConfig(partition_bytes=16, credit_bytes=32, timeout_s=20)
    world = InProcessWorld(2)
    results = [None, None]

    def rank(r):
        with Scheduler(world.backend(r), ArrayOps(), config, store=world.store) as s:
            t = array.array("d", [float(r + 1)] * 10)
            s.wait(s.submit("grad", t, priority=0))
            s.mark_step()
            s.synchronize()
            results[r] = list(t)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    world.close()
    assert results == [[3.0] * 10, [3.0] * 10], results
    leaked = sorted(m for m in %r if m in sys.modules and sys.modules[m] is not None)
    assert not leaked, leaked
    print("OK")
    """
) % (BLOCKED, BLOCKED)


def test_core_imports_and_reduces_with_every_framework_unimportable():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stdout.strip().endswith("OK")


def test_importing_commsched_loads_no_framework_or_logging_handlers():
    code = textwrap.dedent(
        """
        import logging, sys
        import commsched, commsched.backends, commsched.scheduler
        loaded = sorted(m for m in %r if m in sys.modules)
        assert not loaded, loaded
        assert logging.getLogger().handlers == [], logging.getLogger().handlers
        assert logging.getLogger("commsched").handlers == []
        import threading
        assert [t.name for t in threading.enumerate() if t.name.startswith("commsched")] == []
        print("OK")
        """
    ) % (BLOCKED,)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
