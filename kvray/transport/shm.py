"""`shm` transport: same node, CPU. The decode backing lives in a shared-memory file; the
writer maps only the peer's registered span (never the slack around it) and copies every op
into it with batched C copies on a few threads.

A peer's region names a path, and a path is only a claim: the writer opens it only if it is a
file kvray itself creates (directly in the configured `shm_dir`, under kvray's name pattern),
without following a symbolic link, and only if it is a regular file owned by this user, sealed
by its owner as a region of the very engine incarnation that publishes it (a decode engine seals
its file when it registers: `kvray.owned.seal_owned_file`), and long enough for the region. So a
peer can publish no other engine's file as its own. Before every write it checks again that the
path still names the file it mapped and that the file still covers the region: a peer that
shrank its file (ftruncate) gets a `RegionError`, not a writer killed by SIGBUS. What remains is
a race no check can close: a process of this user that shrinks the file between that check and
the copy still kills the writer; kvray's own engines never shrink a backing while it is
published.

A removed file stays in RAM for as long as anyone maps it, and a writer may never write to a
departed peer again to find out it left: so every write first lets go of the peers whose file
is gone (at most once per `heartbeat_s`, and whenever a new region is to be mapped), and the
mappings kept are bounded in bytes (`max_mapped_bytes`) as well as in peers.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np

from kvray.config import Settings
from kvray.errors import (
    KvrayError,
    MetadataError,
    NotExpectedError,
    RegionError,
    StaleIncarnationError,
    TransportError,
    WriteFailedError,
)
from kvray.layout import Int64Array
from kvray.memory import Backing, MemoryKind, SourceReady
from kvray.metrics import EngineMetrics
from kvray.owned import PeerPath, open_peer, read_seal, seal_owned_file
from kvray.placement import NOTHING, Stored, region_salt
from kvray.plan import TransferPlan
from kvray.transport.base import OnStored, Peer, PeerCache, Reach, Transport, check_write, region_pairs
from kvray.transport.cpu_copy import ClaimSlot, Hashing, copy_rows, scatter_copy_async
from kvray.wire import EngineInfo, RegionDescriptor, TransportKind


class _RegionSeal(msgspec.Struct, frozen=True, kw_only=True):
    """What a decode engine seals its shared-memory file with when it registers it: the engine
    incarnation whose regions the file holds."""

    engine_id: str
    incarnation: int


_seal_encoder = msgspec.msgpack.Encoder()
_seal_decoder = msgspec.msgpack.Decoder(_RegionSeal)


def _sealed_for(seal: bytes) -> _RegionSeal | None:
    try:
        return _seal_decoder.decode(seal)
    except msgspec.DecodeError:
        return None


@dataclass
class _Mapping:
    """A peer region mapped into this process: exactly [handle_offset, handle_offset + length).

    Copies in flight hold it (`users`); forgetting the peer only retires it, and the last
    copy out unmaps it, so no thread ever writes into an address that was unmapped (or,
    worse, mapped again for a newer incarnation).
    """

    mm: mmap.mmap
    array: np.ndarray
    length: int
    path: str
    #: The file, open for as long as it is mapped: asked after, not looked up by its path.
    fd: int
    #: One past the mapped span's last byte in the file: the file must keep at least this many.
    file_end: int
    users: int = 0
    retired: bool = False

    @property
    def address(self) -> int:
        return int(self.array.ctypes.data)

    def file_state(self) -> int | None:
        """The file's size, or None once the owner removed it (it closed, or a restart on this
        node swept the dead life's files, and no name links to it any more): writing into the
        mapping would reach memory nobody reads. One `fstat` of the open file (no walk of its
        path), so it is cheap enough to ask before every write."""
        try:
            status = os.fstat(self.fd)
        except OSError:
            return None
        if status.st_nlink == 0:
            return None
        return status.st_size

    def retire(self) -> None:
        self.retired = True
        if self.users == 0:
            self._unmap()

    def release(self) -> None:
        self.users -= 1
        if self.retired and self.users == 0:
            self._unmap()

    def _unmap(self) -> None:
        del self.array
        self.mm.close()
        os.close(self.fd)


class ShmTransport(Transport):
    kind = TransportKind.SHM
    needs = "both engines on one node and a writable shared-memory folder (KVRAY_SHM_DIR)"
    reach = Reach.SAME_NODE
    source_kinds = frozenset({MemoryKind.CPU, MemoryKind.SHM})
    destination_kinds = frozenset({MemoryKind.SHM})
    registers = frozenset({MemoryKind.SHM})

    def __init__(self, settings: Settings, metrics: EngineMetrics | None = None) -> None:
        super().__init__(settings, metrics)
        #: The peers' regions mapped here, by region index.
        self._mappings: PeerCache[int, _Mapping] = PeerCache(
            settings.max_cached_peers,
            _Mapping.retire,
            nbytes=lambda mapping: mapping.length,
            max_nbytes=settings.max_mapped_bytes,
        )
        #: When the mappings were last checked for peers that left (`time.monotonic`).
        self._checked_at = time.monotonic()

    @classmethod
    def accepts(cls, peer: EngineInfo) -> bool:
        return all(region.transport is cls.kind and region.handle for region in peer.regions)

    @classmethod
    def unavailable_reason(cls, settings: Settings) -> str | None:
        if not os.path.isdir(settings.shm_dir) or not os.access(settings.shm_dir, os.W_OK):
            return f"shared-memory folder {settings.shm_dir} is missing or not writable (KVRAY_SHM_DIR)"
        return None

    def register(
        self, backing: Backing, engine_id: str, incarnation: int, *, remote_writable: bool
    ) -> tuple[RegionDescriptor, ...]:
        if remote_writable and backing.kind is not MemoryKind.SHM:
            raise RegionError(
                f"the shm transport writes into shared-memory backings; engine {engine_id!r} has a "
                f"{backing.kind.value} backing (allocate it with MemoryKind.SHM)",
                engine_id=engine_id,
            )
        descriptors = super().register(backing, engine_id, incarnation, remote_writable=remote_writable)
        if remote_writable:
            seal = _seal_encoder.encode(_RegionSeal(engine_id=engine_id, incarnation=incarnation))
            for path in {region.shm_path for region in backing.regions if region.shm_path is not None}:
                seal_owned_file(path, seal)
        return descriptors

    def hashes(self, local: Backing, peer: Peer) -> bool:
        return local.kind is not MemoryKind.CUDA

    async def write(
        self, plan: TransferPlan, local: Backing, peer: Peer, *, ready: SourceReady = None
    ) -> Stored:
        return await self._copy(plan, local, peer, None)

    async def write_then(
        self, plan: TransferPlan, local: Backing, peer: Peer, then: OnStored, *, ready: SourceReady = None
    ) -> Stored:
        return await self._copy(plan, local, peer, then)

    async def _copy(
        self, plan: TransferPlan, local: Backing, peer: Peer, then: Callable[[Stored], None] | None
    ) -> Stored:
        check_write(plan, local, peer)
        ops = plan.ops
        pairs = region_pairs(ops.local_region, ops.remote_region)
        info = peer.info
        self._sweep_before_mapping(info, [remote for (_, remote), _ in pairs])
        # Every region is opened and checked before the first byte moves.
        mappings = {remote_index: self._map(peer, remote_index) for (_, remote_index), _ in pairs}
        stored = NOTHING
        for number, ((local_index, remote_index), select) in enumerate(pairs, start=1):
            source = local.regions[local_index].tensor
            if source.is_cuda:
                raise TransportError("the shm transport copies from CPU memory; use cuda_ipc for GPUs")
            remote_offset = ops.remote_offset[select]
            nbytes = ops.nbytes[select]
            # After an earlier pair's copy, check the file again: the peer had time to change it.
            mapping = mappings[remote_index] if number == 1 else self._map(peer, remote_index)
            mapping.users += 1
            try:
                stored = await scatter_copy_async(
                    mapping.address,
                    source.data_ptr(),
                    remote_offset,
                    ops.local_offset[select],
                    nbytes,
                    self.settings.copy_threads,
                    # On the copy thread that wrote the plan's last byte.
                    then=then if number == len(pairs) else None,
                    salt=region_salt(remote_index),
                    base=stored,
                    hashing=Hashing.between(local_index, remote_index) if plan.hashed else None,
                )
            except (asyncio.CancelledError, KvrayError):
                raise
            except Exception as error:
                raise WriteFailedError(
                    f"copy into engine {peer.info.engine_id!r} region {remote_index} failed: {error}",
                    engine_id=peer.info.engine_id,
                ) from error
            finally:
                mapping.release()
        return stored

    async def write_rows(
        self,
        peer: Peer,
        local: Backing,
        rows: Int64Array,
        ids: Int64Array,
        nbytes: int,
        claim: ClaimSlot,
        notice: tuple[int, bytes, bytes, int] | None,
        *,
        hashed: bool,
        request_id: str,
    ) -> tuple[Stored, bool] | None:
        """A request's whole push between region 0 of each side, planned by the C copy from its
        rows and paired block ids (`kvray.transport.cpu_copy.copy_rows`), which checks every op
        against both regions, holds the request's claim slot until its last byte and `notice`
        are out, and sends `notice` from the thread that copies the last byte. What it stored
        and whether the notice went; None (nothing written) while the engine holds the slot."""
        info = peer.info
        self._sweep_before_mapping(info, [0])
        mapping = self._map(peer, 0)
        source = local.regions[0].tensor
        mapping.users += 1
        try:
            return await copy_rows(
                mapping.address,
                source.data_ptr(),
                rows,
                ids,
                local.regions[0].nbytes,
                mapping.length,
                nbytes,
                threads=self.settings.copy_threads,
                notice=notice,
                claim=claim,
                salt=region_salt(0),
                hashing=Hashing.between(0, 0) if hashed else None,
            )
        except LookupError as error:
            raise NotExpectedError(
                f"engine {info.engine_id!r} no longer expects request {request_id!r} under this "
                f"reservation (its wait ended, it was released, or the reservation is forged); nothing "
                f"was written ({error})",
                request_id=request_id,
                engine_id=info.engine_id,
            ) from None
        except ValueError as error:
            raise RegionError(
                f"a push of {request_id!r} into engine {info.engine_id!r} would leave a region: {error}; "
                "nothing was written",
                request_id=request_id,
                engine_id=info.engine_id,
            ) from error
        except (asyncio.CancelledError, KvrayError):
            raise
        except Exception as error:
            raise WriteFailedError(
                f"copy into engine {info.engine_id!r} region 0 failed: {error}", engine_id=info.engine_id
            ) from error
        finally:
            mapping.release()

    def _sweep_before_mapping(self, info: EngineInfo, regions: list[int]) -> None:
        """Before a write holds a mapping: a region to map is memory about to grow, so unmap the
        peers that left first (and every `heartbeat_s` in any case). The peer written keeps its
        own: `_map` tells its writer that peer is gone."""
        due = time.monotonic() - self._checked_at >= self.settings.heartbeat_s
        mapped = (self._mappings.get(info.engine_id, info.incarnation, index) for index in regions)
        if due or any(mapping is None for mapping in mapped):
            self._forget_departed(keep=info.engine_id)

    def pinned(self, peer: Peer, index: int) -> _Mapping:
        """Region `index` of `peer` mapped (checked as before a write) and held mapped until
        the caller's `release()`: for copies that others start (`kvray.agent.lane`)."""
        self._sweep_before_mapping(peer.info, [index])
        mapping = self._map(peer, index)
        mapping.users += 1
        return mapping

    def _map(self, peer: Peer, index: int) -> _Mapping:
        info = peer.info
        mapping = self._mappings.get(info.engine_id, info.incarnation, index)
        if mapping is not None:
            size = mapping.file_state()
            if size is None:
                self._mappings.pop(info.engine_id, info.incarnation, index)
                raise StaleIncarnationError(
                    f"incarnation {info.incarnation} of engine {info.engine_id!r} is over: its "
                    f"shared memory {mapping.path} was removed (the engine closed or restarted); "
                    "look the engine up again",
                    engine_id=info.engine_id,
                    stale_incarnation=info.incarnation,
                )
            if size < mapping.file_end:
                # Touching a mapped page past the file's end raises SIGBUS, which kills the process.
                self._mappings.pop(info.engine_id, info.incarnation, index)
                raise RegionError(
                    f"engine {info.engine_id!r} shrank its shared memory {mapping.path} to {size} "
                    f"bytes, short of region {index}'s end at {mapping.file_end}; nothing was "
                    "written (an engine must not shrink a published backing)",
                    engine_id=info.engine_id,
                    region=index,
                    path=mapping.path,
                    file_nbytes=size,
                )
            return mapping
        region = info.regions[index]
        path = region.handle.decode()
        if not path:
            raise TransportError(
                f"engine {info.engine_id!r} region {index} has no shared-memory file; its backing "
                "is not in shared memory",
                engine_id=info.engine_id,
            )
        if region.handle_offset % mmap.ALLOCATIONGRANULARITY:
            raise RegionError(
                f"engine {info.engine_id!r} region {index} starts {region.handle_offset} bytes into its "
                f"file, not a multiple of {mmap.ALLOCATIONGRANULARITY}",
                engine_id=info.engine_id,
            )
        fd = open_peer(
            path,
            PeerPath.SHARED_FILE,
            self.settings.shm_dir,
            named_by=f"engine {info.engine_id!r} region {index}",
            engine_id=info.engine_id,
            region=index,
        )
        try:
            status = os.fstat(fd)
            data_end = self._check_seal(info, index, path, fd, status.st_size)
            file_end = region.handle_offset + region.length
            if file_end > data_end:
                raise RegionError(
                    f"engine {info.engine_id!r} describes region {index} as "
                    f"[{region.handle_offset}, {file_end}) of {path}, but the file holds {data_end} "
                    "bytes of data",
                    engine_id=info.engine_id,
                )
            mm = mmap.mmap(
                fd,
                region.length,
                mmap.MAP_SHARED,
                mmap.PROT_READ | mmap.PROT_WRITE,
                offset=region.handle_offset,
            )
        except BaseException:
            os.close(fd)
            raise
        mapping = _Mapping(mm, np.frombuffer(mm, dtype=np.uint8), region.length, path, fd, file_end)
        self._mappings.put(info.engine_id, info.incarnation, index, mapping)
        return mapping

    @staticmethod
    def _check_seal(info: EngineInfo, index: int, path: str, fd: int, size: int) -> int:
        """Refuse a file its owner did not seal for this engine incarnation; where its data ends."""
        sealed = read_seal(fd, size)
        owner = _sealed_for(sealed[0]) if sealed is not None else None
        if sealed is not None and owner == _RegionSeal(
            engine_id=info.engine_id, incarnation=info.incarnation
        ):
            return sealed[1]
        if owner is not None and owner.engine_id == info.engine_id:
            raise StaleIncarnationError(
                f"engine {info.engine_id!r} region {index} names {path}, which now holds incarnation "
                f"{owner.incarnation}, not {info.incarnation}; nothing was written (look it up again)",
                engine_id=info.engine_id,
                incarnation=owner.incarnation,
                stale_incarnation=info.incarnation,
                path=path,
            )
        held = f"engine {owner.engine_id!r}'s regions" if owner is not None else "no sealed regions"
        raise MetadataError(
            f"engine {info.engine_id!r} region {index} names {path}, a file that holds {held}; a "
            "region must be a file its own engine sealed when it registered, and nothing was written",
            engine_id=info.engine_id,
            region=index,
            path=path,
        )

    def _forget_departed(self, keep: str) -> None:
        """Unmap every peer but `keep` one of whose files is gone (it closed, or a restart on this
        node swept a dead one's files): one `stat` per mapping."""
        self._checked_at = time.monotonic()
        self._mappings.forget_where(lambda mapping: mapping.file_state() is None, keep=keep)

    def forget(self, engine_id: str) -> None:
        self._mappings.forget(engine_id)

    async def close(self) -> None:
        self._mappings.clear()
