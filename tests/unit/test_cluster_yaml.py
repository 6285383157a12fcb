"""ray_cluster.yaml passes Ray's own cluster-config validation, and its prefill/decode node types
offer exactly the custom resources kvray's workers ask for."""

from __future__ import annotations

from pathlib import Path

import yaml

from kvray.workers import DECODE_RESOURCE, PREFILL_RESOURCE

CONFIG = Path(__file__).resolve().parents[2] / "ray_cluster.yaml"


def test_cluster_yaml_passes_rays_validation() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(CONFIG.read_text())
    validate_config(prepare_config(config))


def test_node_types_offer_the_resources_workers_request() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    types = config["available_node_types"]
    assert PREFILL_RESOURCE in types["prefill"]["resources"]
    assert DECODE_RESOURCE in types["decode"]["resources"]
    assert PREFILL_RESOURCE not in types["decode"]["resources"]
    assert DECODE_RESOURCE not in types["prefill"]["resources"]
    assert not types[config["head_node_type"]]["resources"]
