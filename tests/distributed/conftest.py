"""A local Ray cluster for the distributed buffers' tests: 127.0.0.1 only, the machine's 2 CPUs.

Ray picks the machine's outward address as its node address unless told that it runs a
single-machine cluster (the switch Ray uses on Windows and macOS, where it binds every server to
the loopback address). The switch is set for this process and, through the environment, for
every process of the cluster.
"""

from __future__ import annotations

import pytest

_RAY_INIT = {
    "num_cpus": 2,
    "include_dashboard": False,
    "object_store_memory": 256 * 1024**2,
    "configure_logging": False,
    "log_to_driver": False,
}


@pytest.fixture(scope="module")
def ray_cluster():
    """Starts a local cluster for the module and shuts it down after its last test."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        # Read by ray.init through ray._private.services at call time: the loopback node address.
        mp.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
        if ray.is_initialized():
            ray.shutdown()
        ray.init(**_RAY_INIT)
        try:
            assert ray.util.get_node_ip_address() == "127.0.0.1"
            yield ray
        finally:
            ray.shutdown()
