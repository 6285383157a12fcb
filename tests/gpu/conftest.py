"""Every test here needs a CUDA device: the `gpu` tier (`tests/conftest.py`)."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def cuda_device() -> None:
    """Skip where there is no CUDA device."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on a GPU machine: tests/gpu/run_on_device.sh)")
