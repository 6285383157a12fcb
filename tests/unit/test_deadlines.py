"""Every timeout a caller or an operator gives is checked and bounded: NaN, infinities,
non-numbers and values not above zero are refused with a `ConfigError` naming the argument,
and a finite but huge value is clamped to `Settings.max_timeout_s` (nothing waits forever)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from agent_pair import agent_pair

import kvray.coordinator as coordinator_module
from kvray.agent import KVAgent
from kvray.config import TIMEOUT_CEILING_S, Settings
from kvray.coordinator import MAX_LOOKUP_WAIT_S, Coordinator
from kvray.errors import ConfigError, TransferTimeoutError, UnknownEngineError
from kvray.layout import BlockOrder, mixed

LAYOUT = mixed(8, BlockOrder.LAYER_MAJOR)

BAD_TIMEOUTS = [math.nan, math.inf, -math.inf, 0, 0.0, -1.0, "5", b"5", True, [1.0]]


# ---- the one check ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", BAD_TIMEOUTS, ids=repr)
def test_deadline_refuses_what_is_not_a_finite_positive_number(value: object) -> None:
    with pytest.raises(ConfigError, match="timeout") as caught:
        Settings().deadline(value, 1.0, "timeout")
    assert caught.value.setting == "timeout"


@pytest.mark.parametrize("value", [1e12, 1e300, 10**30, 301.0])
def test_deadline_clamps_to_max_timeout_s(value: float) -> None:
    assert Settings().deadline(value, 1.0, "timeout") == Settings().max_timeout_s == 300.0
    assert (
        Settings(
            max_timeout_s=5.0, transfer_timeout_s=5.0, lookup_timeout_s=5.0, notify_timeout_s=5.0
        ).deadline(value, 1.0, "timeout")
        == 5.0
    )


def test_deadline_takes_numbers_and_defaults() -> None:
    settings = Settings()
    assert settings.deadline(None, 7.5, "timeout") == 7.5
    assert settings.deadline(2, 7.5, "timeout") == 2.0
    assert settings.deadline(np.float32(0.25), 7.5, "timeout") == 0.25
    assert settings.deadline(0.0, 7.5, "wait_s", allow_zero=True) == 0.0
    with pytest.raises(ConfigError):
        settings.deadline(-0.5, 7.5, "wait_s", allow_zero=True)
    with pytest.raises(ConfigError):
        settings.deadline(math.nan, 7.5, "wait_s", allow_zero=True)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_timeout_s", math.nan),
        ("max_timeout_s", math.inf),
        ("max_timeout_s", 0.0),
        ("max_timeout_s", TIMEOUT_CEILING_S * 2),
        ("transfer_timeout_s", 1e12),
        ("lookup_timeout_s", 301.0),
        ("notify_timeout_s", math.nan),
        ("heartbeat_s", 1000.0),
        ("max_cached_peers", 0),
        ("max_mapped_bytes", 0),
    ],
)
def test_settings_bound_their_own_waits(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        Settings(**{field: value})  # type: ignore[arg-type]
    assert caught.value.setting == field


def test_max_timeout_s_comes_from_the_environment() -> None:
    settings = Settings.from_env({"KVRAY_MAX_TIMEOUT_S": "900", "KVRAY_TRANSFER_TIMEOUT_S": "600"})
    assert (settings.max_timeout_s, settings.transfer_timeout_s) == (900.0, 600.0)
    with pytest.raises(ConfigError, match="KVRAY_TRANSFER_TIMEOUT_S"):
        Settings.from_env({"KVRAY_TRANSFER_TIMEOUT_S": "1e12"})


# ---- every entry of an agent ---------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="function")
async def agents(tmp_path: Path) -> AsyncIterator[tuple[KVAgent, KVAgent]]:
    settings = Settings(
        shm_dir=str(tmp_path),
        transport="shm",
        max_timeout_s=2.0,
        transfer_timeout_s=2.0,
        lookup_timeout_s=2.0,
        notify_timeout_s=2.0,
        heartbeat_s=2.0,
    )
    async with agent_pair("t", LAYOUT, settings) as pair:
        yield pair


def _destination_bytes(decode: KVAgent) -> bytes:
    allocation = decode.backing.regions[0].allocation
    assert allocation is not None
    return bytes(allocation.numpy())


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -3.0, "10"], ids=repr)
async def test_agent_entries_refuse_bad_timeouts_before_a_byte_moves(
    agents: tuple[KVAgent, KVAgent], value: Any
) -> None:
    prefill, decode = agents
    async with asyncio.timeout(60):  # the test's own guard: an unchecked NaN or inf may wait forever
        decode.backing.regions[0].allocation.numpy()[:] = 0xA5  # type: ignore[union-attr]
        reservation = decode.expect("r", [2, 3])
        before = _destination_bytes(decode)
        first = LAYOUT.layer_names[0]
        with pytest.raises(ConfigError, match="timeout"):
            await prefill.push(reservation, [0, 1], timeout=value)
        with pytest.raises(ConfigError, match="timeout"):
            await prefill.push_layer(reservation, first, [0, 1], timeout=value)
        with pytest.raises(ConfigError, match="timeout"):
            await decode.wait_for_kv("r", timeout=value)
        assert _destination_bytes(decode) == before
        # The request is still expected and the push still goes through afterwards.
        await prefill.push_layer(reservation, first, [0, 1], timeout=2.0)
        with pytest.raises(ConfigError, match="timeout"):
            await prefill.finish("r", timeout=value)


async def test_a_huge_wait_is_clamped_to_max_timeout_s(agents: tuple[KVAgent, KVAgent]) -> None:
    _, decode = agents
    decode.expect("never", [4])
    async with asyncio.timeout(60):  # the test's own guard: without the clamp this waits forever
        with pytest.raises(TransferTimeoutError) as caught:
            await decode.wait_for_kv("never", timeout=1e12)
    assert caught.value.timeout_s == 2.0


# ---- the coordinator's lookup: any Ray caller may name its wait ---------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0, "5", b"5", True], ids=repr)
async def test_a_coordinator_lookup_refuses_a_wait_that_is_not_finite_and_positive(value: Any) -> None:
    coordinator = Coordinator()
    async with asyncio.timeout(60):  # the test's own guard: an unchecked NaN or inf waits forever
        with pytest.raises(ConfigError, match="timeout_s") as caught:
            await coordinator.lookup("nobody", value)
    assert caught.value.setting == "timeout_s"
    with pytest.raises(ConfigError, match="lapse_s"):
        Coordinator(lapse_s=value)


async def test_a_coordinator_lookup_waits_at_most_its_named_maximum(monkeypatch: pytest.MonkeyPatch) -> None:
    coordinator = Coordinator()
    asked: list[float] = []
    real_timeout = asyncio.timeout

    def timeout(delay: float) -> Any:
        asked.append(delay)
        return real_timeout(0.01)  # what was asked is recorded; the test need not wait a day

    monkeypatch.setattr(coordinator_module.asyncio, "timeout", timeout)
    with pytest.raises(UnknownEngineError) as caught:
        await coordinator.lookup("nobody", 1e12)
    monkeypatch.undo()
    assert asked == [MAX_LOOKUP_WAIT_S] and caught.value.timeout_s == MAX_LOOKUP_WAIT_S
    assert MAX_LOOKUP_WAIT_S == TIMEOUT_CEILING_S
    # A wait of zero is an answer now, and an engine that is there is found at once.
    with pytest.raises(UnknownEngineError):
        await coordinator.lookup("nobody", 0)
