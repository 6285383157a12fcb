"""Workers ask for their node type's custom resource where the cluster offers it (the resources
ray_cluster.yaml gives prefill and decode nodes), and for nothing where it does not."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ray_starts import start_local_ray

from kvray.wire import Role
from kvray.workers import DECODE_RESOURCE, PREFILL_RESOURCE, DecodeActor, placement_options

pytestmark = pytest.mark.usefixtures("own_ray")


def test_no_resource_asked_without_ray() -> None:
    import ray

    if ray.is_initialized():
        pytest.skip("Ray is running in this process")
    assert placement_options(Role.PREFILL) == {}


@pytest.fixture(scope="module")
def typed_ray() -> Iterator[None]:
    import ray

    start_local_ray(num_cpus=4, resources={PREFILL_RESOURCE: 2, DECODE_RESOURCE: 2})
    yield
    ray.shutdown()


def test_placement_follows_the_node_types(typed_ray: None) -> None:
    import ray

    from kvray.layout import llama_gqa

    assert placement_options(Role.PREFILL) == {"resources": {PREFILL_RESOURCE: 1}}
    assert placement_options(Role.DECODE) == {"resources": {DECODE_RESOURCE: 1}}
    decode = DecodeActor.options(**placement_options(Role.DECODE)).remote(
        "placed-decode", llama_gqa(4, num_layers=1)
    )
    ray.get(decode.start.remote())
    assert ray.available_resources().get(DECODE_RESOURCE, 0) == 1
    ray.kill(decode)
