"""ray_cluster.yaml passes Ray's own cluster-config validation, its prefill/decode node types
offer exactly the custom resources kvray's workers ask for, and it keeps Ray's trust boundary
closed: token authentication on every node, the dashboard on the head's loopback address."""

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


def test_every_node_runs_with_token_auth_and_the_dashboard_stays_on_loopback() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    starts = [
        command
        for key in ("head_start_ray_commands", "worker_start_ray_commands")
        for command in config[key]
        if "ray start" in command
    ]
    assert len(starts) == 2
    for command in starts:
        assert command.split("; ")[-1].startswith("RAY_AUTH_MODE=token ray start"), command
        # Decode engines take notices from other nodes on a pinned port range.
        assert "KVRAY_NOTICE_PORT=20000 KVRAY_NOTICE_PORTS=64" in command, command
    (head,) = [command for command in starts if "--head" in command]
    assert "--dashboard-host=127.0.0.1" in head.split(), head
    text = CONFIG.read_text()
    assert "0.0.0.0" not in text and "RAY_AUTH_MODE=disabled" not in text
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


def test_nodes_install_the_tested_versions_with_the_pip_they_have() -> None:
    """Setup never upgrades pip at boot (a pip no one tested), and every install it runs is held
    to constraints/tested.txt, the versions CI tests with."""
    config = yaml.safe_load(CONFIG.read_text())
    commands = config["setup_commands"]
    assert not [command for command in commands if "--upgrade pip" in command or "-U pip" in command]
    assert "--upgrade pip" not in CONFIG.read_text()
    installs = [command for command in commands if "pip install" in command]
    assert installs, commands
    for command in installs:
        assert '-c "$HOME/kvray/constraints/tested.txt"' in command, command
    assert (CONFIG.parent / "constraints" / "tested.txt").is_file()
    ci = (CONFIG.parent / ".ci" / "run").read_text()
    assert "pip install -q -c constraints/tested.txt -e '.[dev,vllm]'" in ci
