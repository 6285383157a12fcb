"""The loopback notice channel users test with, beside the loopback transport: two agents of one
process complete requests with no socket and no Ray, whole and layer by layer, and a notice the
decode engine refuses raises at the writer as through any channel that answers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.errors import NotExpectedError
from kvray.layout import mixed
from kvray.notice.local import ENDPOINT as INBOX_ENDPOINT
from kvray.notice.loopback import LoopbackChannel, NoticeNetwork
from kvray.transport.loopback import LoopbackNetwork, LoopbackTransport
from kvray.wire import Role

LAYOUT = mixed(8)


@pytest_asyncio.fixture(loop_scope="function")
async def pair(tmp_path: Path) -> AsyncIterator[tuple[KVAgent, KVAgent, NoticeNetwork]]:
    transports, notices = LoopbackNetwork(), NoticeNetwork()
    settings = Settings(shm_dir=str(tmp_path), transfer_timeout_s=5.0, notify_timeout_s=5.0)
    agents = [
        KVAgent(
            f"lbn-{role.value}",
            role,
            LAYOUT,
            settings=settings,
            use_coordinator=False,
            transports=[LoopbackTransport(transports)],
            notices=[LoopbackChannel(notices)],
        )
        for role in (Role.PREFILL, Role.DECODE)
    ]
    prefill, decode = agents
    for agent in agents:
        await agent.start()
    prefill.add_peer(decode.info)
    try:
        yield prefill, decode, notices
    finally:
        for agent in agents:
            await agent.close()


async def test_requests_complete_through_the_loopback_channel(
    pair: tuple[KVAgent, KVAgent, NoticeNetwork],
) -> None:
    prefill, decode, notices = pair
    # The decode engine still has its inbox: the loopback channel is tried first, not instead.
    assert INBOX_ENDPOINT in decode.info.endpoints
    reservation = decode.expect("whole", [1, 2])
    result = await prefill.push(reservation, [3, 4])
    completion = await decode.wait_for_kv("whole", timeout=5.0)
    assert completion.nbytes == result.nbytes
    layerwise = decode.expect("layers", [5])
    for layer in LAYOUT.layer_names:
        await prefill.push_layer(layerwise, layer, [6])
    await prefill.finish("layers")
    await decode.wait_for_kv("layers", timeout=5.0)
    assert notices.notices == 2
    assert decode.stats["completions_ok"] == 2


async def test_a_refused_notice_raises_at_the_writer(pair: tuple[KVAgent, KVAgent, NoticeNetwork]) -> None:
    prefill, decode, notices = pair
    reservation = decode.expect("r", [1])
    for layer in LAYOUT.layer_names:
        await prefill.push_layer(reservation, layer, [2])
    # The decode engine stops expecting the request between the last layer and the finish.
    decode.cancel("r")
    with pytest.raises(NotExpectedError, match="does not expect request 'r'"):
        await prefill.finish("r", timeout=5.0)
    # The finish's notice, then perhaps already the failure notice that follows a refusal.
    assert notices.notices >= 1
    assert decode.stats["messages_dropped_unknown"] >= 1
    assert decode.stats["completions_ok"] == 0
