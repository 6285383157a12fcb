"""The completion notice sent from the copy thread: on one node, a push's notice goes out from
the thread that wrote its last byte (`Transport.write_then`; with the C extension, a pool
thread sends it without Python), not after a trip back through the writer's event loop. It
must never go before the last byte, go exactly once, and fall back to the usual send (which
waits, or raises a kvray error) when it cannot be queued at once."""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from agent_pair import agent_pair

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.errors import TransportError
from kvray.layout import Geometry, KVLayout, LayerSpec
from kvray.notice.local import CompletionInbox, CompletionOutbox, DatagramNotice, LocalChannel
from kvray.transport import cpu_copy

# 16 KiB blocks: a 512-block request is 8 MiB, above the size that is copied by pool threads.
LAYOUT = KVLayout(
    layers=(LayerSpec(name="kv", geometry=Geometry(block_size=16, entry_shape=(1024,), dtype="uint8")),),
    num_blocks=1024,
)
BLOCK = LAYOUT.layer("kv").geometry.block_nbytes


def _inbox(agent: KVAgent) -> CompletionInbox | None:
    """The decode agent's own inbox (its local notice channel's receiving end)."""
    local = next(channel for channel in agent._notices.channels if isinstance(channel, LocalChannel))
    return local.inbox


@pytest_asyncio.fixture(loop_scope="function")
async def agents(tmp_path: Path) -> AsyncIterator[tuple[KVAgent, KVAgent]]:
    settings = Settings(shm_dir=str(tmp_path), transport="shm", notify_timeout_s=2.0, copy_threads=2)
    async with agent_pair("e", LAYOUT, settings) as (prefill, decode):
        source = prefill.backing.regions[0].tensor.numpy()
        source[:] = np.random.default_rng(5).integers(0, 256, source.size, dtype=np.uint8)
        decode.backing.regions[0].tensor.numpy()[:] = 0xA5
        yield prefill, decode


def blocks(pool: Any, ids: np.ndarray) -> np.ndarray:
    return np.stack([pool[i * BLOCK : (i + 1) * BLOCK] for i in ids.tolist()])


def request(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.permutation(LAYOUT.num_blocks)[:count], rng.permutation(LAYOUT.num_blocks)[:count]


@pytest.fixture(params=["pool", "python-threads"])
def copies(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Who copies: the C extension's pool (which sends the notice without Python), or the
    fallback's Python threads."""
    if request.param == "pool" and not cpu_copy.native():
        pytest.skip("kvray._copy_pool (the C extension) is not built here")
    if request.param == "python-threads":
        monkeypatch.setattr(cpu_copy, "_start_copy", None)
    return str(request.param)


@pytest.mark.parametrize("held", [True, False], ids=["held", "hashed-while-copied"])
async def test_the_notice_leaves_from_a_copy_thread_after_the_last_byte(
    agents: tuple[KVAgent, KVAgent], copies: str, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the writer's reference held (`hold_digests`), the notice is ready before the copy
    starts and leaves from its thread. Without, the reference of a request this large is hashed
    on a thread while the copy runs, and the notice leaves from the event loop once both are
    done: once, after every byte, either way."""
    prefill, decode = agents
    local, remote = request(512, seed=1)
    if held:
        await prefill.hold_digests(local)
    assert local.size * BLOCK > cpu_copy._PARALLEL_THRESHOLD
    source = prefill.backing.regions[0].tensor.numpy()
    target = decode.backing.regions[0].tensor.numpy()
    untouched = np.setdiff1d(np.arange(LAYOUT.num_blocks), remote)
    python_sends: list[int] = []
    arrivals: list[tuple[bool, bool]] = []
    real_try_send = CompletionOutbox.try_send
    real_send = CompletionOutbox.send

    def spying_try_send(outbox: CompletionOutbox, path: str, message: bytes) -> bool:
        python_sends.append(threading.get_ident())
        return real_try_send(outbox, path, message)

    async def spying_send(outbox: CompletionOutbox, path: str, message: bytes) -> None:
        python_sends.append(threading.get_ident())
        await real_send(outbox, path, message)

    monkeypatch.setattr(CompletionOutbox, "try_send", spying_try_send)
    monkeypatch.setattr(CompletionOutbox, "send", spying_send)
    inbox = _inbox(decode)
    assert inbox is not None
    handle = inbox._handler

    def arriving(message: bytes) -> None:
        # The decode side reads the notice: every byte must be there already.
        landed = np.array_equal(blocks(target, remote), blocks(source, local))
        canaries = bool((blocks(target, untouched) == 0xA5).all())
        arrivals.append((landed, canaries))
        handle(message)

    monkeypatch.setattr(inbox, "_handler", arriving)
    reservation = decode.expect("big", remote)
    await prefill.push(reservation, local)
    await decode.wait_for_kv("big", timeout=5.0)

    assert arrivals == [(True, True)], "the notice came before every byte had landed, or a canary moved"
    if copies == "pool" and held:
        assert python_sends == [], "the pool's thread did not send the notice itself"
    else:  # equal shares on Python threads (no thread knows it wrote the last byte), or a
        # reference still being hashed: the loop sends it
        assert len(python_sends) == 1
    assert decode.stats["completions_ok"] == 1
    assert decode.stats["messages_dropped_unknown"] == 0


async def test_a_notice_that_cannot_be_queued_at_once_goes_the_usual_way(
    agents: tuple[KVAgent, KVAgent], copies: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    prefill, decode = agents
    monkeypatch.setattr(CompletionOutbox, "try_send", lambda *_: False)
    real_datagram = DatagramNotice.datagram

    def nowhere(notice: DatagramNotice) -> tuple[int, bytes, bytes]:
        fileno, _, message = real_datagram(notice)
        return fileno, os.fsencode(str(tmp_path / "nobody-listens")), message

    monkeypatch.setattr(DatagramNotice, "datagram", nowhere)
    for count, request_id in ((512, "big"), (4, "small")):
        local, remote = request(count, seed=count)
        reservation = decode.expect(request_id, remote)
        await prefill.push(reservation, local)
        await decode.wait_for_kv(request_id, timeout=5.0)
        target = decode.backing.regions[0].tensor.numpy()
        assert np.array_equal(
            blocks(target, remote), blocks(prefill.backing.regions[0].tensor.numpy(), local)
        )
    assert decode.stats["completions_ok"] == 2
    assert decode.stats["messages_dropped_unknown"] == 0


async def test_a_gone_inbox_is_still_a_transport_error(agents: tuple[KVAgent, KVAgent]) -> None:
    prefill, decode = agents
    local, remote = request(512, seed=3)
    reservation = decode.expect("orphan", remote)
    inbox = _inbox(decode)
    assert inbox is not None
    # Only the inbox goes: the claim board next to it stays, so the write itself is allowed.
    inbox._socket.close()
    os.unlink(inbox.path)
    # Found before the write (checking the claim board's folder) or at the notice.
    with pytest.raises(TransportError, match=r"could not notify|is gone"):
        await prefill.push(reservation, local)
    await decode.release("orphan")
