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

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from ray_starts import start_local_ray
from vllm_installed import require_vllm

from kvray.wire import EngineInfo

# ---- tiers -----------------------------------------------------------------------------------
#
# A test's tier follows from the fixtures it uses, directly or through other fixtures (and a
# module's `pytestmark = pytest.mark.usefixtures(...)`): `ray` (a Ray of its own or the shared
# one), `vllm` (vLLM engines), `gpu` (a CUDA device: tests/gpu), and `fast` for every test of
# none of these and not `extended`. `pytest -m fast` is the developer's loop; the default run
# takes every tier but `extended`. Modules run cheapest tier first, so the shared Ray starts once
# for every module that uses it, and a module that needs its own Ray stops it before.

#: The tier each of these fixtures puts a test in.
TIER_OF_FIXTURE = {
    "local_ray": "ray",
    "own_ray": "ray",
    "two_node_cluster": "ray",
    "vllm_pool": "vllm",
    "vllm_ready": "vllm",
    "cuda_device": "gpu",
}
TIERS = ("ray", "vllm", "gpu")


def tiers_of(item: pytest.Item) -> set[str]:
    names = getattr(item, "fixturenames", ())
    return {TIER_OF_FIXTURE[name] for name in names if name in TIER_OF_FIXTURE}


def _module_rank(items: list[pytest.Item]) -> int:
    """Modules that share a Ray run next to each other: 0 no Ray; 1 the shared local Ray; 2 a Ray
    of the module's own; 3 the shared two-node Ray; 4 the same with vLLM engines (the engine
    pool); 5 vLLM engines on a Ray of the module's own."""
    names = {name for item in items for name in getattr(item, "fixturenames", ())}
    vllm = "vllm_ready" in names
    if "two_node_cluster" in names:
        return 4 if vllm else 3
    if "own_ray" in names:
        return 5 if vllm else 2
    return 1 if "local_ray" in names else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tiers = tiers_of(item)
        for tier in tiers:
            item.add_marker(tier)
        if not tiers and item.get_closest_marker("extended") is None:
            item.add_marker("fast")
    # The extended tier runs only when asked for by name (`-m extended`, `-m "vllm or extended"`):
    # `-m ray` or `-m vllm` alone leaves it out, as the default run does.
    if "extended" not in (config.option.markexpr or ""):
        extended = [item for item in items if item.get_closest_marker("extended") is not None]
        if extended:
            config.hook.pytest_deselected(items=extended)
            items[:] = [item for item in items if item.get_closest_marker("extended") is None]
    # Whole modules, in their own order, cheapest first.
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    ordered = sorted(enumerate(modules.values()), key=lambda pair: (_module_rank(pair[1]), pair[0]))
    items[:] = [item for _, module_items in ordered for item in module_items]


class SessionRay:
    """The Ray that modules share, of one of two kinds: `local` (`local_ray`) or `two-node` (two
    Ray nodes of this machine: `two_node_cluster` and the vLLM engine pool). It is started when a
    module first needs it, replaced when a module needs the other kind, and stopped while a
    module runs a Ray of its own (`own_ray`); the engines the pool shares die with it."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.cluster: Any = None
        #: tests/integrations/engine_pool.py's `EnginePool`, once a module used it.
        self.engines: Any = None

    def use(self, kind: str) -> Any:
        import ray

        if self.kind == kind:
            return self.cluster
        self.stop()
        if kind == "local":
            start_local_ray(num_cpus=8)
        else:
            from ray.cluster_utils import Cluster

            # Loopback addresses: see RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER above.
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": 4,
                    "resources": {"node_a": 10},
                    "node_ip_address": "127.0.0.1",
                    "include_dashboard": False,
                },
            )
            self.cluster.add_node(num_cpus=4, resources={"node_b": 10}, node_ip_address="127.0.0.1")
            self.cluster.wait_for_nodes()
            ray.init(address=self.cluster.address, log_to_driver=False, namespace="kvray-tests")
        self.kind = kind
        return self.cluster

    def stop(self) -> None:
        import ray

        if self.kind is None:
            return
        if self.engines is not None:
            self.engines.close()
        ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
        self.kind = None

    def clear(self) -> None:
        """What a module leaves behind that the next one must not find: its named actors (the
        coordinator among them: it is detached), so each module starts with an empty directory,
        as on a Ray of its own."""
        import ray

        for actor in ray.util.list_named_actors(all_namespaces=True):
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))


@pytest.fixture(scope="session")
def session_ray() -> Iterator[SessionRay]:
    shared = SessionRay()
    yield shared
    shared.stop()


@pytest.fixture(scope="module")
def local_ray(session_ray: SessionRay) -> Iterator[None]:
    """The shared local Ray, for the whole module (started if need be)."""
    session_ray.use("local")
    yield
    session_ray.clear()


@pytest.fixture(scope="module")
def own_ray(session_ray: SessionRay) -> None:
    """The module starts a Ray of its own (another configuration, or its commands start theirs):
    the shared one is stopped first."""
    session_ray.stop()


@pytest.fixture(scope="module")
def two_node_cluster(session_ray: SessionRay) -> Any:
    """Two Ray nodes on this machine (loopback addresses), each with its own custom resource
    (`node_a`, `node_b`), shared by the modules that use them (with their coordinator: engines
    the pool shares stay registered in it)."""
    return session_ray.use("two-node")


@pytest.fixture(scope="module")
def vllm_pool(two_node_cluster: Any, vllm_ready: None, session_ray: SessionRay) -> Iterator[Any]:
    """vLLM engines on the two-node Ray, the module's own or shared with other modules
    (`tests/integrations/engine_pool.py`)."""
    from engine_pool import EnginePool, ModuleEngines

    if session_ray.engines is None:
        session_ray.engines = EnginePool()
    engines = ModuleEngines(session_ray.engines)
    yield engines
    engines.close()


@pytest.fixture(scope="session")
def vllm_ready() -> None:
    """vLLM, transformers and the test model's package are installed (else the test is skipped)."""
    require_vllm()


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
