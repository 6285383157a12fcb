"""The soak's quick variant: 500 randomized transfers between real actors (random layouts and
the mixed one, both block orders, shm and ray, whole and layer-wise, 16 at once), canaries over
every decode allocation. The full run is `python examples/soak.py` (10,000 transfers); both
share `examples/soak.py`."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

SOAK = Path(__file__).resolve().parents[2] / "examples" / "soak.py"
QUICK_TRANSFERS = 500


@pytest.fixture(scope="module")
def soak(local_ray: None) -> Iterator[ModuleType]:
    """examples/soak.py as a module, shipped to the actors by value (examples/ is not a package)."""
    import ray.cloudpickle

    spec = importlib.util.spec_from_file_location("kvray_soak_example", SOAK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)
    yield module
    ray.cloudpickle.unregister_pickle_by_value(module)
    del sys.modules[spec.name]


def test_quick_soak(soak: ModuleType, figures: Callable[[str], None]) -> None:
    report = asyncio.run(soak.run_soak(QUICK_TRANSFERS, seed=7, groups=2, concurrency=16, sweep=100))
    figures(report.line() + " [quick variant; full run: python examples/soak.py]")
    assert report.failed == 0, f"transfers failed: {dict(report.errors)}"
    assert report.transfers == QUICK_TRANSFERS
    assert report.corrupt_bytes == 0
    assert report.leaked_blocks == 0
    assert set(report.by_transport) == {"shm", "ray"}
    assert set(report.by_kind) == {"whole", "layer-wise"}
    assert {group.split()[0] for group in report.groups} == {"layer_major", "block_major"}
