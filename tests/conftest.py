"""Process-wide test settings, applied before anything imports Ray."""

import os

# Ray reads this at import time. With it off, every node of a test cluster (and the driver)
# uses the loopback address; otherwise a second node on this machine binds eth0's address and
# hangs connecting to the head.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Several vLLM engines (each a worker with an OpenMP thread per core) share this machine's cores
# in the integration tests. OpenMP threads that spin while they wait for work take the cores
# from the engine that has work; passive ones sleep. Every process the tests start (Ray workers,
# vLLM's engine cores and workers, the README's commands) inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every request's KV checked (`Settings.integrity_sample_rate`, read by `Settings.from_env` in
# every process the tests start): the tests exercise the check on every transfer, not on the
# default's one in a hundred. Tests of sampling set their own rate; the README's commands run
# without it (`tests/e2e/test_readme_flows.py`), as a user's would.
os.environ.setdefault("KVRAY_INTEGRITY_SAMPLE_RATE", "1.0")

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvray.wire import EngineInfo


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray instance for the whole module."""
    import ray

    ray.init(
        address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, namespace="kvray-tests"
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def two_node_cluster() -> Iterator[Any]:
    """Two Ray nodes on this machine (loopback addresses), each with its own custom resource."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "resources": {"node_a": 10},
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )
    cluster.add_node(num_cpus=4, resources={"node_b": 10}, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, namespace="kvray-tests")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def canary_mask() -> Any:
    """The function below, for tests: which allocation bytes given requests may write."""
    return written_mask


def written_mask(
    info: EngineInfo,
    region_offset: int,
    allocation_nbytes: int,
    requests: list[tuple[list[int], list[str] | None]],
) -> np.ndarray:
    """Bytes of a decode allocation that the given (blocks, layers) requests may write."""
    mask = np.zeros(allocation_nbytes, dtype=bool)
    for blocks, layers in requests:
        for layer in layers or info.layout.layer_names:
            placement = info.placements[layer]
            for block in blocks:
                for part in range(placement.parts):
                    start = region_offset + placement.byte_offset(part, block)
                    mask[start : start + placement.part_nbytes] = True
    return mask
