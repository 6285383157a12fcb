"""How the tests start a local Ray: the shared one (`tests/conftest.py`) and a module's own."""

from __future__ import annotations

from typing import Any


def start_local_ray(**options: Any) -> None:
    """A new local Ray for this process (never one already running on the machine), with the
    tests' namespace, no dashboard and no worker logs on the driver; `options`: more
    `ray.init` arguments."""
    import ray

    ray.init(
        address="local", include_dashboard=False, log_to_driver=False, namespace="kvray-tests", **options
    )
