"""What only the shm transport has: it maps a peer's shared-memory file into this process.

It maps exactly the registered span (never the slack around it), writes only into regions
published as remotely writable, refuses a peer it cannot open with an error that says why, keeps
one mapping per peer incarnation, and never unmaps memory a copy is still writing into.
"""

from __future__ import annotations

import asyncio
import dataclasses
import mmap
import os
import secrets
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import pytest

from kvray.errors import KvrayError, MetadataError, RegionError, StaleIncarnationError, TransportError
from kvray.layout import BlockOrder, KVLayout, mixed
from kvray.memory import Backing, MemoryKind

if TYPE_CHECKING:
    from conftest import Engine, GatedCopies, TransportUnderTest


def small_layout() -> KVLayout:
    return mixed(num_blocks=16, block_order=BlockOrder.LAYER_MAJOR)


def with_region(engine: Engine, **changes: object) -> Engine:
    """`engine` as a forged or broken description would present it (its memory unchanged)."""
    region = msgspec.structs.replace(engine.info.regions[0], **changes)
    return dataclasses.replace(engine, info=msgspec.structs.replace(engine.info, regions=(region,)))


def shm_path(engine: Engine) -> str:
    path = engine.backing.regions[0].shm_path
    assert path is not None
    return path


# ---- least privilege ------------------------------------------------------------------------------


def test_register_refuses_a_writable_region_outside_shared_memory(shm: TransportUnderTest) -> None:
    backing = Backing.allocate(small_layout(), MemoryKind.CPU)
    shm.backings.append(backing)
    with pytest.raises(RegionError, match="shared-memory"):
        shm.transport.register(backing, "decode-0", 7, remote_writable=True)
    # A prefill engine's CPU backing may register as long as it exposes nothing.
    (region,) = shm.transport.register(backing, "prefill-0", 7, remote_writable=False)
    assert not region.remote_writable


async def test_maps_exactly_the_registered_span(shm: TransportUnderTest) -> None:
    source = shm.source(small_layout())
    destination = shm.destination(small_layout())
    path = shm_path(destination)
    region = destination.info.regions[0]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    # The backing's own mapping covers its whole allocation: region plus slack.
    assert [end - start for start, end, _ in shm.maps(path)] == [
        destination.backing.regions[0].span.alloc_nbytes
    ]
    assert destination.backing.regions[0].span.alloc_nbytes > region.length

    local, remote = shm.scattered(16, 4)
    for _ in range(2):  # the second write reuses the first one's mapping
        await shm.write(shm.plan(source, destination, local, remote), source, destination)

    owners = shm.maps(path)
    assert len(owners) == 2, f"expected the backing's mapping and one transport mapping, got {owners}"
    transport_mappings = [
        (start, end, offset) for start, end, offset in owners if end - start == region.length
    ]
    assert len(transport_mappings) == 1, f"no mapping of exactly the region's {region.length} bytes: {owners}"
    (_start, _end, offset) = transport_mappings[0]
    assert offset == region.handle_offset
    assert [m.length for m in shm.transport._mappings.values()] == [region.length]  # type: ignore[attr-defined]

    await shm.transport.close()
    assert len(shm.maps(path)) == 1, "close() left the peer's file mapped"


# ---- peers it cannot reach ---------------------------------------------------------------------------


async def test_peer_whose_file_is_missing_must_be_on_this_node(shm: TransportUnderTest) -> None:
    source = shm.source(small_layout())
    destination = shm.destination(small_layout())
    missing = f"{shm.transport.settings.shm_dir}/kvray-{os.getpid()}-{secrets.token_hex(8)}"
    elsewhere = with_region(destination, handle=missing.encode())
    local, remote = shm.scattered(16, 4)
    plan = shm.plan(source, elsewhere, local, remote)
    before = shm.snapshot(destination)

    with pytest.raises(TransportError, match="node") as raised:
        await shm.transport.write(plan, source.backing, shm.peer(elsewhere))

    assert missing in str(raised.value) and raised.value.engine_id == "decode-0"
    assert not shm.transport._mappings  # type: ignore[attr-defined]
    shm.assert_unchanged(destination, before)
    # The transport still works for a peer it can reach.
    await shm.write(shm.plan(source, destination, local, remote), source, destination)
    shm.assert_landed(
        shm.plan(source, destination, local, remote), source, destination, before, local, remote
    )


@pytest.mark.parametrize(
    ("broken", "error"),
    [
        pytest.param({"handle": b""}, TransportError, id="no-file"),
        pytest.param({"length": 1 << 40}, RegionError, id="longer-than-file"),
        pytest.param({"handle_offset": mmap.ALLOCATIONGRANULARITY // 2}, RegionError, id="misaligned-offset"),
        pytest.param({"handle_offset": 1 << 40}, RegionError, id="offset-past-file"),
    ],
)
async def test_broken_region_descriptor_is_refused(
    shm: TransportUnderTest, broken: dict[str, object], error: type[KvrayError]
) -> None:
    source = shm.source(small_layout())
    destination = shm.destination(small_layout())
    bad = with_region(destination, **broken)
    local, remote = shm.scattered(16, 4)
    plan = shm.plan(source, destination, local, remote)
    before = shm.snapshot(destination)

    with pytest.raises(error):
        await shm.transport.write(plan, source.backing, shm.peer(bad))

    shm.assert_unchanged(destination, before)
    assert len(shm.maps(shm_path(destination))) == 1


# ---- one mapping per peer incarnation -------------------------------------------------------------------


async def test_new_incarnation_releases_the_old_mapping(shm: TransportUnderTest) -> None:
    source = shm.source(small_layout())
    old = shm.destination(small_layout(), engine_id="decode-0")
    local, remote = shm.scattered(16, 4)
    await shm.write(shm.plan(source, old, local, remote), source, old)
    assert len(shm.maps(shm_path(old))) == 2

    new = shm.destination(small_layout(), engine_id="decode-0")
    await shm.write(shm.plan(source, new, local, remote), source, new)

    # The old life's file is no longer mapped by the writer (an unlinked file stays in RAM while mapped).
    assert len(shm.maps(shm_path(old))) == 1
    assert len(shm.maps(shm_path(new))) == 2

    shm.transport.forget("decode-0")
    assert len(shm.maps(shm_path(new))) == 1


# ---- never unmap under a running copy ------------------------------------------------------------------


@pytest.mark.parametrize("release", ["forget", "close", "new-incarnation"])
async def test_mapping_outlives_the_copies_writing_into_it(
    shm: TransportUnderTest, gated: GatedCopies, release: str
) -> None:
    source = shm.source(small_layout())
    destination = shm.destination(small_layout(), engine_id="decode-0")
    peer_files = [shm_path(destination)]

    def mapped_file(low: int, high: int) -> str | None:
        for path in peer_files:
            if any(start <= low and high <= end for start, end, _ in shm.maps(path)):
                return path
        return None

    gated.where = mapped_file
    local, remote = shm.scattered(16, 8)
    plan = shm.plan(source, destination, local, remote)
    before = shm.snapshot(destination)
    write = asyncio.create_task(shm.write(plan, source, destination))
    assert await asyncio.to_thread(gated.entered.wait, 10)

    other = None
    if release == "forget":
        shm.transport.forget("decode-0")
    elif release == "close":
        await shm.transport.close()
    else:  # a concurrent write to the peer's next incarnation maps it and drops the old one
        restarted = shm.destination(small_layout(), engine_id="decode-0")
        peer_files.append(shm_path(restarted))
        other = asyncio.create_task(shm.write(shm.plan(source, restarted, local, remote), source, restarted))
        for _ in range(100):
            if len(shm.maps(shm_path(restarted))) == 2:
                break
            await asyncio.sleep(0.01)
    gated.gate.set()
    await write
    if other is not None:
        await other
    await gated.drained()

    assert gated.unsafe == [], (
        f"{len(gated.unsafe)} copies would have written into a peer region after it was unmapped "
        "(into nothing, or into whatever was mapped there next)"
    )
    shm.assert_landed(plan, source, destination, before, local, remote)


# ---- forged or broken paths: a peer's handle is only a claim ------------------------------------


def _victim(tmp_path: Path, nbytes: int) -> tuple[Path, bytes]:
    """An unrelated file of this user, big enough for the region, that no write may touch."""
    victim = tmp_path / "unrelated.bin"
    content = secrets.token_bytes(nbytes)
    victim.write_bytes(content)
    return victim, content


async def test_a_path_outside_the_shm_folder_is_refused(shm: TransportUnderTest, tmp_path: Path) -> None:
    source = shm.source(small_layout())
    destination = shm.destination(small_layout())
    region = destination.info.regions[0]
    victim, content = _victim(tmp_path, region.handle_offset + region.length)
    # Named like a kvray file, but in another folder.
    forged_path = tmp_path / f"kvray-{os.getpid()}-{secrets.token_hex(8)}"
    victim.rename(forged_path)
    forged = with_region(destination, handle=str(forged_path).encode())
    local, remote = shm.scattered(16, 4)

    with pytest.raises(MetadataError, match="not a kvray shared-memory file") as raised:
        await shm.transport.write(shm.plan(source, forged, local, remote), source.backing, shm.peer(forged))

    assert raised.value.engine_id == "decode-0" and raised.value.path == str(forged_path)
    assert forged_path.read_bytes() == content


@pytest.mark.parametrize("name", ["unrelated", "kvray-..-x", "kvray-1-abc/../kvray-1-abc"])
async def test_a_path_not_named_like_kvray_files_is_refused(shm: TransportUnderTest, name: str) -> None:
    source = shm.source(small_layout())
    destination = shm.destination(small_layout())
    forged = with_region(destination, handle=f"{shm.transport.settings.shm_dir}/{name}".encode())
    local, remote = shm.scattered(16, 4)
    with pytest.raises(MetadataError, match="not a kvray shared-memory file"):
        await shm.transport.write(shm.plan(source, forged, local, remote), source.backing, shm.peer(forged))


async def test_a_symbolic_link_under_a_kvray_name_is_not_followed(
    shm: TransportUnderTest, tmp_path: Path
) -> None:
    source = shm.source(small_layout())
    destination = shm.destination(small_layout())
    region = destination.info.regions[0]
    victim, content = _victim(tmp_path, region.handle_offset + region.length)
    link = Path(shm.transport.settings.shm_dir) / f"kvray-{os.getpid()}-{secrets.token_hex(8)}"
    link.symlink_to(victim)
    try:
        forged = with_region(destination, handle=str(link).encode())
        local, remote = shm.scattered(16, 4)
        before = shm.snapshot(destination)
        with pytest.raises(MetadataError, match="symbolic link"):
            await shm.transport.write(
                shm.plan(source, forged, local, remote), source.backing, shm.peer(forged)
            )
    finally:
        link.unlink()
    assert victim.read_bytes() == content
    shm.assert_unchanged(destination, before)


async def test_a_kvray_named_fifo_is_not_a_regular_file(shm: TransportUnderTest) -> None:
    source = shm.source(small_layout())
    destination = shm.destination(small_layout())
    fifo = Path(shm.transport.settings.shm_dir) / f"kvray-{os.getpid()}-{secrets.token_hex(8)}"
    os.mkfifo(fifo, 0o600)
    try:
        forged = with_region(destination, handle=str(fifo).encode(), handle_offset=0)
        local, remote = shm.scattered(16, 4)
        with pytest.raises(MetadataError, match="not a regular file"):
            await shm.transport.write(
                shm.plan(source, forged, local, remote), source.backing, shm.peer(forged)
            )
    finally:
        fifo.unlink()


# ---- a region is bound to the engine that sealed its file ------------------------------------------


async def test_a_region_naming_another_engines_file_is_refused_before_a_byte_moves(
    shm: TransportUnderTest,
) -> None:
    source = shm.source(small_layout())
    victim = shm.destination(small_layout(), engine_id="decode-0")
    liar = shm.destination(small_layout(), engine_id="decode-1")
    theirs = victim.info.regions[0]
    # decode-1 publishes decode-0's file (a kvray file of this user, long enough) as its region.
    forged = with_region(liar, handle=theirs.handle, handle_offset=theirs.handle_offset, length=theirs.length)
    local, remote = shm.scattered(16, 4)
    plan = shm.plan(source, liar, local, remote)
    before_victim, before_liar = shm.snapshot(victim), shm.snapshot(liar)

    with pytest.raises(MetadataError, match="holds engine 'decode-0'") as raised:
        await shm.transport.write(plan, source.backing, shm.peer(forged))

    assert type(raised.value) is MetadataError and raised.value.engine_id == "decode-1"
    shm.assert_unchanged(victim, before_victim, "the other engine's allocation")
    shm.assert_unchanged(liar, before_liar)
    assert len(shm.maps(shm_path(victim))) == 1, "the writer mapped the other engine's file"
    # Each engine's own description still works.
    await shm.write(shm.plan(source, victim, local, remote), source, victim)
    await shm.write(plan, source, liar)


async def test_a_file_registered_again_refuses_its_earlier_incarnation(shm: TransportUnderTest) -> None:
    source = shm.source(small_layout())
    backing = Backing.allocate(small_layout(), MemoryKind.SHM)
    old = shm.destination(small_layout(), backing=backing)
    new = shm.destination(small_layout(), backing=backing)
    local, remote = shm.scattered(16, 4)
    before = shm.snapshot(new)
    with pytest.raises(StaleIncarnationError) as raised:
        await shm.write(shm.plan(source, old, local, remote), source, old)
    assert raised.value.stale_incarnation == old.incarnation
    shm.assert_unchanged(new, before)
    await shm.write(shm.plan(source, new, local, remote), source, new)


_SHRINKING_PEER = textwrap.dedent(
    """
    import asyncio, os, sys
    import numpy as np
    from kvray.config import Settings
    from kvray.errors import KvrayError
    from kvray.layout import BlockOrder, mixed
    from kvray.memory import Backing, MemoryKind
    from kvray.plan import plan_transfer
    from kvray.transport.base import Peer
    from kvray.transport.shm import ShmTransport
    from kvray.wire import Role

    async def main() -> None:
        layout = mixed(num_blocks=16, block_order=BlockOrder.LAYER_MAJOR)
        transport = ShmTransport(Settings())
        source = Backing.allocate(layout, MemoryKind.CPU)
        destination = Backing.allocate(layout, MemoryKind.SHM)
        exposed = transport.register(source, "prefill-0", 1, remote_writable=False)
        source_info = source.engine_info("prefill-0", 1, Role.PREFILL, "n", exposed)
        writable = transport.register(destination, "decode-0", 2, remote_writable=True)
        destination_info = destination.engine_info("decode-0", 2, Role.DECODE, "n", writable)
        plan = plan_transfer(source_info, destination_info, [15, 3], [15, 4])
        peer = Peer(destination_info)
        await transport.write(plan, source, peer)  # maps the peer's file
        os.truncate(destination.regions[0].shm_path, 4096)
        try:
            await transport.write(plan, source, peer)
        except KvrayError as error:
            print("refused:", type(error).__name__, error)
        else:
            print("wrote into a shrunk file")
        await transport.close()

    asyncio.run(main())
    """
)


def test_a_peer_that_shrinks_its_file_gets_an_error_not_a_dead_writer(tmp_path: Path) -> None:
    # Touching a mapped page past a file's end raises SIGBUS, which kills the whole process:
    # the writer runs in a child, so that is an exit status here rather than a dead test run.
    result = subprocess.run(
        [sys.executable, "-c", _SHRINKING_PEER], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, f"writer died (status {result.returncode}): {result.stderr[-2000:]}"
    assert "refused: RegionError" in result.stdout and "shrank" in result.stdout, result.stdout
