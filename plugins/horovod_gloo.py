"""Horovod's gloo rendezvous for benchmark workers, as ``horovodrun --gloo`` does it.

Shared by the torch and TensorFlow benchmarks. It lives in the plugins, not in the
framework-free core, because it imports ``horovod.runner``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from commsched.bench.procs import RENDEZVOUS_PORT_FILE, horovod_gloo_env

__all__ = ["horovod_gloo_rendezvous"]


def horovod_gloo_rendezvous(
    *, rank: int, world_size: int, nodes: int, run_dir: str | os.PathLike, master_addr: str,
    ifname: str, timeout_s: float = 60.0,
) -> dict[str, str]:
    """Rendezvous for ``hvd.init()`` with gloo, as ``horovodrun --gloo`` does it.

    Rank 0 starts Horovod's HTTP rendezvous server (a thread of this process)
    and publishes its port in ``run_dir``; the server's thread serves until
    this process exits. Every rank waits at most ``timeout_s`` for that port
    and returns the variables of :func:`horovod_gloo_env`: put them in
    ``os.environ``, then call ``hvd.init()``. Ranks are spread evenly over ``nodes`` hosts
    named ``node0..``. Needs only ``horovod.runner`` (no framework); raises
    ``ImportError`` when Horovod is not installed.
    """
    if nodes < 1 or world_size % nodes:
        raise ValueError(f"world_size {world_size} must be a multiple of nodes {nodes}")
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    per_node = world_size // nodes
    plan = get_host_assignments(parse_hosts(",".join(f"node{i}:{per_node}" for i in range(nodes))), world_size)
    port_file = Path(run_dir) / RENDEZVOUS_PORT_FILE
    if rank == 0:
        server = RendezvousServer()
        port = server.start()
        server.init(plan)
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        os.replace(tmp, port_file)  # atomic: readers never see a half-written port
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the Horovod rendezvous port never appeared in {port_file} within {timeout_s:.0f} s"
                " (rank 0 failed to start; see its log)"
            )
        time.sleep(0.05)
    return horovod_gloo_env(master_addr, port_file.read_text().strip(), ifname, plan[rank])
