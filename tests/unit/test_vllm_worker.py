"""The parts of the vLLM connector's worker side that need no vLLM: the layout read from vLLM's
cache tensors, the shared-memory placement of its KV allocation and its adoption as one backing,
the settings from `kv_connector_extra_config`, and the push request on the wire."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch

from kvray.agent.handoff import NO_BLOCK, PUSH_ENDPOINT, HandoffStep, LayerwiseSpec, LoadSpec, SendSpec
from kvray.config import Settings
from kvray.errors import BackpressureError, ConfigError, RegionError, TransferTimeoutError, WireDecodeError
from kvray.integrations.vllm.cache_layout import layout_of
from kvray.integrations.vllm.worker import ConnectorWorker, settings_from
from kvray.memory import Backing, MemoryKind
from kvray.owned import is_owned_name
from kvray.wire import (
    PushRequest,
    Reservation,
    Role,
    TransportKind,
    decode_notice,
    decode_push_request,
    encode,
)

NUM_BLOCKS, BLOCK_SIZE = 6, 16


def vllm_cpu_caches(buffer: torch.Tensor, layers: int = 3) -> dict[str, torch.Tensor]:
    """Per-layer views of one int8 buffer, as vLLM's CPU backend lays them out: [blocks, KV heads,
    tokens, 2 x head_dim] bf16, layer after layer."""
    per_layer = NUM_BLOCKS * 2 * BLOCK_SIZE * 8
    typed = buffer.view(torch.bfloat16)
    return {
        f"model.layers.{i}.self_attn": typed[i * per_layer : (i + 1) * per_layer].view(
            NUM_BLOCKS, 2, BLOCK_SIZE, 8
        )
        for i in range(layers)
    }


def test_the_layout_comes_from_the_real_cache_tensors() -> None:
    caches = vllm_cpu_caches(torch.zeros(3 * NUM_BLOCKS * 2 * BLOCK_SIZE * 8 * 2, dtype=torch.int8))
    cache = layout_of(caches, NUM_BLOCKS, BLOCK_SIZE)
    layout = cache.layout
    assert layout.layer_names == tuple(caches)
    geometry = layout.layer("model.layers.0.self_attn").geometry
    assert (geometry.block_size, geometry.entry_shape, geometry.dtype, geometry.parts) == (
        BLOCK_SIZE,
        (16,),
        "bfloat16",
        1,
    )
    assert geometry.block_layout == "H2 N16 C8"
    for name, tensor in cache.tensors.items():
        assert tensor is caches[name]
        assert cache.strides[name].block_stride == 2 * BLOCK_SIZE * 8 * 2
    split = {"k_and_v": torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 4, 8, dtype=torch.float16)}
    layout = layout_of(split, NUM_BLOCKS, BLOCK_SIZE).layout
    assert layout.layer("k_and_v").geometry.parts == 2


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        (torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, 8)[..., ::2], "no contiguous innermost axis"),
        (torch.zeros(NUM_BLOCKS + 1, 2, BLOCK_SIZE, 8), "block axis"),
        (torch.zeros(NUM_BLOCKS, 3, dtype=torch.float32), "whole tokens"),
    ],
    ids=["strided", "block-axis", "partial-block"],
)
def test_a_cache_kvray_cannot_move_whole_blocks_of_is_refused(tensor: torch.Tensor, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        layout_of({"layer": tensor}, NUM_BLOCKS, BLOCK_SIZE)


def test_the_kv_allocation_lands_in_a_shared_memory_file_adopted_as_one_region(tmp_path: Path) -> None:
    settings = Settings(shm_dir=str(tmp_path))
    worker = ConnectorWorker("vllm-test", Role.DECODE, settings, lease_s=1.0)
    nbytes = 3 * NUM_BLOCKS * 2 * BLOCK_SIZE * 8 * 2 + 4096 * 300
    with worker.allocation_context():
        small = torch.zeros(10, dtype=torch.int8)
        other = torch.zeros(nbytes, dtype=torch.float32)
        buffer = torch.zeros(nbytes, dtype=torch.int8)
    # Only the one int8 CPU buffer of the KV cache is placed; it lies inside the file's mapping.
    path = worker._shm_path
    assert (
        path is not None and os.path.dirname(path) == str(tmp_path) and is_owned_name(os.path.basename(path))
    )
    assert worker._shm_storage <= buffer.data_ptr() < worker._shm_storage + os.path.getsize(path)
    for unplaced in (small, other, torch.zeros(4, dtype=torch.int8)):  # the last: the patch is gone
        assert unplaced.untyped_storage().data_ptr() != worker._shm_storage
    assert buffer.data_ptr() % settings.alignment == 0 and bool((buffer == 0).all())
    caches = vllm_cpu_caches(buffer)
    cache = layout_of(caches, NUM_BLOCKS, BLOCK_SIZE)
    backing = Backing.adopt(
        cache.layout, cache.tensors, settings=settings, shm_path=path, strides=cache.strides
    )
    assert backing.kind is MemoryKind.SHM and len(backing.regions) == 1
    (region,) = backing.region_descriptors("vllm-test", 1, TransportKind.SHM, remote_writable=True)
    assert region.handle == path.encode()
    assert region.handle_offset + region.length <= os.path.getsize(path)
    backing.close()
    assert not os.path.exists(path)


def test_a_producers_kv_allocation_is_aligned_in_one_of_its_own_and_adopted_as_one_region(
    tmp_path: Path,
) -> None:
    """A pure producer (kv_producer) exposes nothing, but its cache is still one registered
    region: placed at an aligned offset of a padded private allocation (vLLM's own would not be
    page-aligned, and the region around it would reach outside it)."""
    settings = Settings(shm_dir=str(tmp_path))
    worker = ConnectorWorker("vllm-p", Role.PREFILL, settings, lease_s=1.0)
    size = 3 * NUM_BLOCKS * 2 * BLOCK_SIZE * 8 * 2
    with worker.allocation_context():
        buffer = torch.zeros(size + 4096 * 300 + 64, dtype=torch.int8)
    assert worker._shm_path is None and os.listdir(tmp_path) == []
    assert buffer.data_ptr() % settings.alignment == 0 and bool((buffer == 0).all())
    cache = layout_of(vllm_cpu_caches(buffer[:size]), NUM_BLOCKS, BLOCK_SIZE)
    backing = Backing.adopt(cache.layout, cache.tensors, settings=settings, strides=cache.strides)
    assert backing.kind is MemoryKind.CPU and len(backing.regions) == 1
    backing.close()


def test_only_a_kvray_shared_memory_file_is_adopted_as_one(tmp_path: Path) -> None:
    caches = vllm_cpu_caches(torch.zeros(3 * NUM_BLOCKS * 2 * BLOCK_SIZE * 8 * 2, dtype=torch.int8))
    cache = layout_of(caches, NUM_BLOCKS, BLOCK_SIZE)
    with pytest.raises(RegionError, match="not a kvray shared-memory file"):
        Backing.adopt(
            cache.layout, cache.tensors, shm_path=str(tmp_path / "someone-elses-file"), strides=cache.strides
        )


def test_a_layer_in_a_storage_too_small_for_an_aligned_region_is_refused(tmp_path: Path) -> None:
    # Layers in storages of their own are a region each; a storage without room for the
    # page-aligned span around its layer (a plain small allocation) is refused before anything
    # is registered, never widened past its bytes.
    worker = ConnectorWorker("vllm-test", Role.DECODE, Settings(shm_dir=str(tmp_path)), lease_s=1.0)
    caches = {f"layer{i}": torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, 8) for i in range(2)}
    with pytest.raises(RegionError, match="outside its allocation"):
        worker.register(caches, NUM_BLOCKS, BLOCK_SIZE)
    worker.shutdown()


def registered_pair(
    tmp_path: Path, *, lease_s: float = 30.0, notify_timeout_s: float = 5.0, transfer_timeout_s: float = 30.0
) -> tuple[ConnectorWorker, ConnectorWorker]:
    """A prefill and a decode worker over kvray shared memory; by default with long leases and
    deadlines (so that what a test sees is not their expiry)."""
    settings = Settings(
        shm_dir=str(tmp_path), notify_timeout_s=notify_timeout_s, transfer_timeout_s=transfer_timeout_s
    )
    prefill = ConnectorWorker("vllm-p", Role.DECODE, settings, lease_s=lease_s)
    decode = ConnectorWorker("vllm-d", Role.DECODE, settings, lease_s=lease_s)
    nbytes = 3 * NUM_BLOCKS * 2 * BLOCK_SIZE * 8 * 2
    for worker in (prefill, decode):
        with worker.allocation_context():
            buffer = torch.zeros(nbytes + (1 << 20), dtype=torch.int8)
        worker.register(vllm_cpu_caches(buffer[:nbytes]), NUM_BLOCKS, BLOCK_SIZE)
    return prefill, decode


def load_from(
    prefill: ConnectorWorker, request_id: str, key: str, blocks: tuple[int, ...], first_block: int = 0
) -> LoadSpec:
    """A decode load of the request `prefill` holds (or will hold) under `key`, as its ticket
    would name it."""
    info = prefill.info
    inbox = info.endpoints[PUSH_ENDPOINT]
    engine, incarnation = info.engine_id, info.incarnation
    return LoadSpec(request_id, engine, incarnation, key, info.node_id, inbox, (blocks,), first_block)


def test_blocks_a_writer_may_still_write_into_stay_out_of_vllms_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The prefill engine refuses (it holds no such request); the decode side's release finds a
    # writer still holding the request: vLLM must not hear of the request (and reuse its blocks)
    # until the agent's quarantine of it ends.
    prefill, decode = registered_pair(tmp_path, lease_s=0.2, notify_timeout_s=1.0, transfer_timeout_s=5.0)
    agent = decode.agent
    writer_gone = threading.Event()  # set by the test: the quarantine may end

    async def held_release(request_id: str) -> None:
        quarantine = agent.quarantined[request_id] = asyncio.Event()

        async def end() -> None:
            await asyncio.to_thread(writer_gone.wait)
            quarantine.set()

        ending.append(asyncio.get_running_loop().create_task(end()))
        raise TransferTimeoutError("a writer still holds it", request_id=request_id)

    ending: list[asyncio.Task[None]] = []

    monkeypatch.setattr(agent, "release", held_release)
    load = load_from(prefill, "d-1", "p-1", (2, 3))
    try:
        decode.begin(HandoffStep(loads={"d-1": load}))
        deadline = time.monotonic() + 20
        while not agent.quarantined and time.monotonic() < deadline:
            prefill.finished()  # expires the early push request: the refusal reaches the decode side
            time.sleep(0.05)
        assert agent.quarantined, "the receive never reached its release"
        time.sleep(0.3)
        assert decode.finished()[1] == set()
        writer_gone.set()
        reported: set[str] = set()
        failed: set[str] = set()
        while "d-1" not in reported and time.monotonic() < deadline:
            _, received, _, errors = decode.finished()
            reported |= received
            failed |= errors
            time.sleep(0.02)
        assert reported == {"d-1"} and failed == {"d-1"}
    finally:
        writer_gone.set()
        prefill.shutdown()
        decode.shutdown()


def reported_within(worker: ConnectorWorker, request_id: str, seconds: float) -> tuple[set[str], set[int]]:
    """Wait until `worker` reports `request_id` received; (failed requests, load-error blocks)."""
    deadline = time.monotonic() + seconds
    failed: set[str] = set()
    errors: set[int] = set()
    while time.monotonic() < deadline:
        _, received, blocks, failures = worker.finished()
        failed |= failures
        errors |= blocks
        if request_id in received:
            return failed, errors
        time.sleep(0.02)
    raise AssertionError(f"{request_id} was not reported within {seconds} s")


def test_a_load_vllm_ends_stops_waiting_and_frees_its_blocks_without_load_errors(tmp_path: Path) -> None:
    # The prefill engine holds no such request yet (it keeps the push request for its lease);
    # vLLM aborts the decode request: the wait ends at once, the blocks are released, and the
    # request is reported received, with no load errors (its blocks are free, not to recompute).
    prefill, decode = registered_pair(tmp_path)
    load = load_from(prefill, "d-1", "p-1", (2, 3))
    try:
        decode.begin(HandoffStep(loads={"d-1": load}))
        time.sleep(0.5)  # the push request is on its way or parked at the prefill engine
        assert decode.finished()[1] == set()
        started = time.monotonic()
        decode.begin(HandoffStep(cancelled={"d-1"}))
        assert reported_within(decode, "d-1", 5.0) == (set(), set())
        assert time.monotonic() - started < 5.0
        # Released: the same request id is reserved again (else that load fails at once).
        again = load_from(prefill, "d-1", "p-2", (2, 3))
        decode.begin(HandoffStep(loads={"d-1": again}))
        time.sleep(0.5)
        decode.begin(HandoffStep(cancelled={"d-1"}))
        assert reported_within(decode, "d-1", 5.0) == (set(), set())
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_push_request_for_a_prefill_request_that_ended_without_kv_is_refused_at_once(
    tmp_path: Path,
) -> None:
    # The decode engine asked before the prefill request ended (aborted): its parked push
    # request is refused then, and one that comes later is refused as it comes, not after the
    # lease; the decode side's wait fails at once and its blocks are load errors.
    prefill, decode = registered_pair(tmp_path)
    first = load_from(prefill, "d-1", "p-1", (2, 3))
    later = load_from(prefill, "d-2", "p-1", (4,))
    try:
        decode.begin(HandoffStep(loads={"d-1": first}))
        time.sleep(0.5)
        assert decode.finished()[1] == set()
        started = time.monotonic()
        prefill.begin(HandoffStep(dropped={"p-1"}))
        assert reported_within(decode, "d-1", 5.0) == ({"d-1"}, {2, 3})
        decode.begin(HandoffStep(loads={"d-2": later}))
        assert reported_within(decode, "d-2", 5.0) == ({"d-2"}, {4})
        assert time.monotonic() - started < 10.0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_settings_come_from_the_extra_config_and_unknown_keys_are_errors() -> None:
    settings = settings_from({"transfer_timeout_s": 7.5, "lease_s": 3.0, "preempt_wait_s": 0.2})
    assert settings.transfer_timeout_s == 7.5
    with pytest.raises(ConfigError, match="bogus"):
        settings_from({"bogus": 1})
    with pytest.raises(ConfigError):
        settings_from({"transfer_timeout_s": "soon"})


def test_an_instrumentation_key_names_the_connector_that_reads_it() -> None:
    with pytest.raises(ConfigError, match=r"DigestLogConnector.*kvray\.bench\.handoff_log"):
        settings_from({"digest_log": "x"})
    with pytest.raises(ConfigError, match=r"SeedBugConnector.*kvray\.faults"):
        settings_from({"seed_bug": True})
    settings_from({"digest_log": "x", "digest_every": 4}, {"digest_log", "digest_every"})  # its own keys


@pytest.mark.parametrize("transport", ["auto", "shm", "ray"])
def test_the_extra_config_picks_the_transport(transport: str) -> None:
    assert settings_from({"transport": transport}).transport == transport


def test_an_unknown_transport_in_the_extra_config_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="transport must be auto, shm, ray, cuda_ipc or verbs, got 'pig'"):
        settings_from({"transport": "pig"})


def test_a_push_request_round_trips_and_is_its_own_family() -> None:
    reservation = Reservation(
        request_id="d-1", engine_id="vllm-d", incarnation=5, blocks=(3, 4), token=99, slot=2
    )
    request = PushRequest(
        request_id="p-1", src_engine="vllm-p", src_incarnation=7, reservation=reservation, first_block=1
    )
    assert decode_push_request(encode(request)) == request
    with pytest.raises(WireDecodeError):
        decode_notice(encode(request))
    raw = msgspec.msgpack.decode(encode(request))
    raw["reservation"]["blocks"] = [-1]
    with pytest.raises(WireDecodeError):
        decode_push_request(msgspec.msgpack.encode(raw))


# ---- the serving boundary: hand-off ids, cancels, releases, preemption ----------------------

KEY = "0" * 31 + "1"


def fill_blocks(worker: ConnectorWorker, values: dict[int, float]) -> None:
    """Every layer's block `b` filled with `values[b]` plus the layer's index (distinct per layer)."""
    for index, view in enumerate(worker.agent.backing.views.values()):
        for block, value in values.items():
            view[block].fill_(value + 16 * index)


def block_values(worker: ConnectorWorker, block: int) -> list[set[float]]:
    """The distinct values in `block` of each layer."""
    return [set(view[block].float().unique().tolist()) for view in worker.agent.backing.views.values()]


def reserve(worker: ConnectorWorker, request_id: str, blocks: list[int]) -> None:
    """Reserve `blocks` for `request_id` on the worker's agent (fails if they are reserved)."""

    async def expect() -> None:
        worker.agent.expect(request_id, blocks)

    assert worker._loop is not None
    worker._loop.run(expect(), timeout=10)


def sent_within(worker: ConnectorWorker, request_id: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if request_id in worker.finished()[0]:
            return
        time.sleep(0.02)
    raise AssertionError(f"{request_id} was not reported sent within {seconds} s")


def test_a_load_cancelled_in_the_turn_it_is_handed_over_is_reported_every_time(tmp_path: Path) -> None:
    # vLLM frees an aborted waiting-for-KV request's blocks only once finished_recving names it:
    # a load and its cancel handed over together (one step, or two back to back) must be reported
    # even when the load's task never took its first step.
    prefill, decode = registered_pair(tmp_path)
    try:
        for index in range(100):
            request_id = f"d-{index}"
            load = load_from(prefill, request_id, f"p-{index}", (2, 3))
            if index % 2:
                decode.begin(HandoffStep(loads={request_id: load}, cancelled={request_id}))
            else:
                decode.begin(HandoffStep(loads={request_id: load}))
                decode.begin(HandoffStep(cancelled={request_id}))
        reported: set[str] = set()
        failed: set[str] = set()
        errors: set[int] = set()
        deadline = time.monotonic() + 20
        while len(reported) < 100 and time.monotonic() < deadline:
            _, received, blocks, failures = decode.finished()
            reported |= received
            failed |= failures
            errors |= blocks
            time.sleep(0.02)
        assert reported == {f"d-{index}" for index in range(100)}
        assert failed == set() and errors == set()
        # Nothing stays reserved: every id can be reserved again.
        for index in range(100):
            reserve(decode, f"d-{index}", [2, 3])
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_second_hold_under_a_held_hand_off_id_ends_at_once_and_never_replaces_the_first(
    tmp_path: Path,
) -> None:
    prefill, decode = registered_pair(tmp_path)
    fill_blocks(prefill, {1: 1.0, 4: 4.0})
    try:
        prefill.begin(HandoffStep(sends={"r-1": SendSpec("r-1", ((1,),), key=KEY)}))
        prefill.begin(HandoffStep(sends={"r-2": SendSpec("r-2", ((4,),), key=KEY)}))
        sent_within(prefill, "r-2", 5.0)  # the newcomer's blocks go back to vLLM at once
        decode.begin(HandoffStep(loads={"d-1": load_from(prefill, "d-1", KEY, (2,))}))
        assert reported_within(decode, "d-1", 10.0) == (set(), set())
        assert block_values(decode, 2) == block_values(prefill, 1)  # the first request's KV
        for canary in (0, 1, 3, 4, 5):
            assert block_values(decode, canary) == [{0.0}] * 3
        sent_within(prefill, "r-1", 5.0)
        # The id is spent: another ask for it is refused at once, and so is another hold.
        decode.begin(HandoffStep(loads={"d-2": load_from(prefill, "d-2", KEY, (3,))}))
        assert reported_within(decode, "d-2", 5.0) == ({"d-2"}, {3})
        prefill.begin(HandoffStep(sends={"r-3": SendSpec("r-3", ((5,),), key=KEY)}))
        sent_within(prefill, "r-3", 5.0)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_released_hold_is_freed_at_once_and_its_ask_refused(tmp_path: Path) -> None:
    prefill, decode = registered_pair(tmp_path, lease_s=60.0)
    try:
        prefill.begin(HandoffStep(sends={"r-1": SendSpec("r-1", ((1,),), key=KEY)}))
        started = time.monotonic()
        prefill.begin(HandoffStep(released={KEY}))
        sent_within(prefill, "r-1", 5.0)
        assert time.monotonic() - started < 5.0
        decode.begin(HandoffStep(loads={"d-1": load_from(prefill, "d-1", KEY, (2,))}))
        assert reported_within(decode, "d-1", 5.0) == ({"d-1"}, {2})
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_load_whose_ticket_was_refused_fails_at_once_with_its_blocks_as_load_errors(tmp_path: Path) -> None:
    prefill, decode = registered_pair(tmp_path)
    try:
        decode.begin(HandoffStep(loads={"d-1": LoadSpec.refused("d-1", ((2, 3),), "not signed")}))
        assert reported_within(decode, "d-1", 5.0) == ({"d-1"}, {2, 3})
        reserve(decode, "d-1", [2, 3])  # nothing was reserved
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_preempted_layerwise_request_is_pushed_whole_from_its_new_blocks(tmp_path: Path) -> None:
    # The decode engine asked first; the prefill's forward saved one layer (pushed from blocks 0
    # and 1), then vLLM preempted the request: once `preempt` returns no copy reads blocks 0 and
    # 1, which vLLM gives to another request. The request runs again in blocks 4 and 5, finishes,
    # and the decode side gets every layer from there.
    prefill, decode = registered_pair(tmp_path)
    fill_blocks(prefill, {0: 1.0, 1: 2.0})
    layers = prefill.agent.layout.layer_names
    try:
        decode.begin(HandoffStep(loads={"d-1": load_from(prefill, "d-1", KEY, (2, 3))}))
        deadline = time.monotonic() + 10
        while not prefill.handoff.parked() and time.monotonic() < deadline:  # the ask is parked
            time.sleep(0.01)
        prefill.begin_layerwise({"r-1": LayerwiseSpec("r-1", KEY, ((0, 1),))})
        prefill.save_layer(layers[0])
        time.sleep(0.2)
        prefill.preempt({KEY})
        fill_blocks(prefill, {0: 7.0, 1: 7.0, 4: 1.0, 5: 2.0})  # reused; the request's KV recomputed
        assert decode.finished()[1] == set()
        prefill.begin(HandoffStep(sends={"r-1": SendSpec("r-1", ((4, 5),), key=KEY)}))
        assert reported_within(decode, "d-1", 10.0) == (set(), set())
        assert block_values(decode, 2) == block_values(prefill, 4)
        assert block_values(decode, 3) == block_values(prefill, 5)
        for canary in (0, 1, 4, 5):
            assert block_values(decode, canary) == [{0.0}] * 3
        sent_within(prefill, "r-1", 5.0)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_load_withdrawn_before_it_began_frees_the_prefill_engines_hold(tmp_path: Path) -> None:
    # The decode request ended before its blocks were allocated (a client hung up while it
    # waited): the prefill engine frees what it holds for it at once, and holds nothing later
    # under that id, instead of keeping it for its lease.
    prefill, decode = registered_pair(tmp_path, lease_s=60.0)
    other = "0" * 31 + "2"
    try:
        prefill.begin(HandoffStep(sends={"r-1": SendSpec("r-1", ((1,),), key=KEY)}))
        started = time.monotonic()
        decode.begin(HandoffStep(withdrawn=[load_from(prefill, "d-1", KEY, ())]))
        sent_within(prefill, "r-1", 5.0)
        decode.begin(HandoffStep(withdrawn=[load_from(prefill, "d-2", other, ())]))
        time.sleep(0.5)
        prefill.begin(
            HandoffStep(sends={"r-2": SendSpec("r-2", ((2,),), key=other)})
        )  # finished after the withdrawal
        sent_within(prefill, "r-2", 5.0)
        assert time.monotonic() - started < 10.0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_cancelled_load_withdraws_its_ask_so_a_later_hold_is_freed_at_once(tmp_path: Path) -> None:
    prefill, decode = registered_pair(tmp_path, lease_s=60.0)
    try:
        decode.begin(HandoffStep(loads={"d-1": load_from(prefill, "d-1", KEY, (2, 3))}))
        deadline = time.monotonic() + 10
        while not prefill.handoff.parked() and time.monotonic() < deadline:  # the ask is parked
            time.sleep(0.01)
        decode.begin(HandoffStep(cancelled={"d-1"}))
        assert reported_within(decode, "d-1", 5.0) == (set(), set())
        deadline = time.monotonic() + 10
        while prefill.handoff.parked() and time.monotonic() < deadline:  # the withdrawal takes the ask back
            time.sleep(0.01)
        assert not prefill.handoff.parked()
        prefill.begin(HandoffStep(sends={"r-1": SendSpec("r-1", ((1,),), key=KEY)}))
        sent_within(prefill, "r-1", 5.0)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_layers_queued_past_the_agents_bound_wait_for_room_instead_of_failing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A decode engine that asks for many layer-wise requests once their forwards have saved
    # every layer queues all their layers at once, more than the agent takes: the agent refuses
    # the excess with BackpressureError (here, the first two tries of every layer). They wait
    # for room, and every request arrives whole.
    prefill, decode = registered_pair(tmp_path)
    push_layer = prefill.agent.push_layer
    tries: dict[tuple[str, str], int] = {}

    async def busy_at_first(reservation: Reservation, layer: str, blocks: object, **kw: object) -> int:
        tried = tries[reservation.request_id, layer] = tries.get((reservation.request_id, layer), 0) + 1
        if tried <= 2:
            raise BackpressureError("full", request_id=reservation.request_id)
        return await push_layer(reservation, layer, blocks)  # type: ignore[arg-type]

    monkeypatch.setattr(prefill.agent, "push_layer", busy_at_first)
    fill_blocks(prefill, {0: 1.0, 1: 2.0, 2: 3.0})
    keys = [f"{index:032x}" for index in range(1, 4)]
    try:
        prefill.begin_layerwise(
            {f"r-{i}": LayerwiseSpec(f"r-{i}", key, ((i,),)) for i, key in enumerate(keys)}
        )
        for layer in prefill.agent.layout.layer_names:
            prefill.save_layer(layer)
        decode.begin(
            HandoffStep(
                loads={f"d-{i}": load_from(prefill, f"d-{i}", key, (i + 3,)) for i, key in enumerate(keys)}
            )
        )
        time.sleep(0.5)  # every ask has come: 9 layers queued at once
        prefill.begin(
            HandoffStep(sends={f"r-{i}": SendSpec(f"r-{i}", ((i,),), key=key) for i, key in enumerate(keys)})
        )
        received: set[str] = set()
        deadline = time.monotonic() + 15
        while len(received) < 3 and time.monotonic() < deadline:
            _, done, errors, failed = decode.finished()
            assert not errors and not failed
            received |= done
            time.sleep(0.02)
        assert received == {"d-0", "d-1", "d-2"}
        for index in range(3):
            assert block_values(decode, index + 3) == block_values(prefill, index)
    finally:
        prefill.shutdown()
        decode.shutdown()


def hybrid_caches(buffer: torch.Tensor | None = None, layers: int = 4) -> dict[str, torch.Tensor]:
    """vLLM's hybrid KV cache manager on a model of sliding-window (even) and full-attention (odd)
    layers: two groups of one page size, and layer `2k` and `2k + 1` share one tensor (a block
    id belongs to one group at a time). Registered in the order vLLM uses: 0, 2, 1, 3. In
    `buffer` (int8, as vLLM allocates it), or in a fresh one."""
    per_layer = NUM_BLOCKS * 2 * BLOCK_SIZE * 8
    nbytes = (layers // 2) * per_layer * 2
    if buffer is None:  # with room for the page-aligned region around it
        buffer = torch.zeros(nbytes + 3 * 4096, dtype=torch.int8)
    skip = -buffer.data_ptr() % 4096
    typed = buffer[skip : skip + nbytes].view(torch.bfloat16)
    shared = [
        typed[i * per_layer : (i + 1) * per_layer].view(NUM_BLOCKS, 2, BLOCK_SIZE, 8)
        for i in range(layers // 2)
    ]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    order = [i for i in range(layers) if i % 2 == 0] + [i for i in range(layers) if i % 2 == 1]
    return {names[i]: shared[i // 2] for i in order}


def hybrid_groups(names: list[str]) -> list[list[str]]:
    return [
        [n for n in names if int(n.split(".")[2]) % 2 == 0],
        [n for n in names if int(n.split(".")[2]) % 2],
    ]


def test_groups_that_share_their_layers_memory_are_one_kvray_layer_per_tensor() -> None:
    caches = hybrid_caches()
    names = list(caches)
    groups = [
        [n for n in names if int(n.split(".")[2]) % 2 == 0],
        [n for n in names if int(n.split(".")[2]) % 2],
    ]
    cache = layout_of(caches, NUM_BLOCKS, BLOCK_SIZE, groups)
    # One kvray layer per tensor, named after its first vLLM layer; both groups' layers map onto it.
    assert cache.layout.layer_names == ("model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn")
    assert cache.layer_of["model.layers.1.self_attn.attn"] == "model.layers.0.self_attn.attn"
    assert cache.users["model.layers.2.self_attn.attn"] == {
        "model.layers.2.self_attn.attn",
        "model.layers.3.self_attn.attn",
    }
    for name, view in cache.tensors.items():
        assert view.data_ptr() == caches[name].data_ptr()


def test_an_mla_cache_is_one_part_of_one_latent_per_token() -> None:
    """DeepSeek's MLA on vLLM's CPU backends: [blocks, 1, tokens, 576] bf16, no K/V split."""
    storage = torch.zeros(4 * NUM_BLOCKS * BLOCK_SIZE * 576, dtype=torch.bfloat16)
    caches = {
        f"model.layers.{i}.self_attn.attn": storage[i * NUM_BLOCKS * BLOCK_SIZE * 576 :][
            : NUM_BLOCKS * BLOCK_SIZE * 576
        ].view(NUM_BLOCKS, 1, BLOCK_SIZE, 576)
        for i in range(4)
    }
    cache = layout_of(caches, NUM_BLOCKS, BLOCK_SIZE, [list(caches)])
    assert len(cache.layout.layers) == 4
    for layer in cache.layout.layers:
        assert (layer.geometry.entry_shape, layer.geometry.parts) == ((576,), 1)


def test_caches_that_overlap_without_being_one_tensor_are_refused() -> None:
    storage = torch.zeros(2 * NUM_BLOCKS * BLOCK_SIZE * 8, dtype=torch.float32)
    half = NUM_BLOCKS * BLOCK_SIZE * 8
    caches = {
        "a": storage[:half].view(NUM_BLOCKS, BLOCK_SIZE, 8),
        "b": storage[half // 2 : half // 2 + half].view(NUM_BLOCKS, BLOCK_SIZE, 8),
    }
    with pytest.raises(ConfigError, match="overlap"):
        layout_of(caches, NUM_BLOCKS, BLOCK_SIZE)


def test_groups_that_do_not_share_their_layers_memory_are_refused_at_start_up() -> None:
    """E.g. an MLA latent group beside an indexer group of another page size: a block id of one
    group would be moved in the other's caches too."""
    caches = {f"layer{i}": torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 8) for i in range(3)}
    with pytest.raises(ConfigError, match="does not share its memory"):
        layout_of(caches, NUM_BLOCKS, BLOCK_SIZE, [["layer0", "layer1"], ["layer2"]])
    with pytest.raises(ConfigError, match="no cache for"):
        layout_of(caches, NUM_BLOCKS, BLOCK_SIZE, [["layer0", "layer1", "layer2", "layer9"]])


def test_a_shared_layer_is_pushed_once_every_vllm_layer_on_it_was_saved(tmp_path: Path) -> None:
    """Layer by layer on a hybrid model: the kvray layer of vLLM layers 0 and 1 goes once both
    are saved, with the blocks of both groups, into the decode engine's blocks of both groups;
    a position the decode engine keeps no block for (a window's past) moves nothing."""
    settings = Settings(shm_dir=str(tmp_path), notify_timeout_s=5.0, transfer_timeout_s=30.0)
    prefill = ConnectorWorker("vllm-hybrid-p", Role.DECODE, settings, lease_s=30.0)
    decode = ConnectorWorker("vllm-hybrid-d", Role.DECODE, settings, lease_s=30.0)
    caches = []
    for worker in (prefill, decode):
        with worker.allocation_context():
            buffer = torch.zeros(NUM_BLOCKS * 2 * BLOCK_SIZE * 8 * 2 * 2 + (1 << 20), dtype=torch.int8)
        caches.append(hybrid_caches(buffer))
    source, destination = caches
    names = list(source)
    tensors = list({id(t): t for t in source.values()}.values())
    for index, tensor in enumerate(tensors):
        for block in range(NUM_BLOCKS):
            tensor[block].fill_(block + 10 * index + 1)
    try:
        prefill.register(source, NUM_BLOCKS, BLOCK_SIZE, hybrid_groups(names))
        decode.register(destination, NUM_BLOCKS, BLOCK_SIZE, hybrid_groups(names))
        held = ((NO_BLOCK, 1), (2, 3))
        prefill.begin_layerwise({"r-1": LayerwiseSpec("r-1", KEY, held)})
        load = LoadSpec(
            "d-1",
            prefill.info.engine_id,
            prefill.info.incarnation,
            KEY,
            prefill.info.node_id,
            prefill.info.endpoints[PUSH_ENDPOINT],
            ((NO_BLOCK, 4), (5, 1)),
            0,
        )
        decode.begin(HandoffStep(loads={"d-1": load}))
        time.sleep(0.3)  # the ask reaches the prefill engine before the forward
        prefill.save_layer(names[0])  # its tensor is layer 1's too, which is not saved yet
        time.sleep(0.3)
        assert not any(bool((t != 0).any()) for t in destination.values())
        for name in names[1:]:
            prefill.save_layer(name)
        prefill.begin(HandoffStep(sends={"r-1": SendSpec("r-1", held, key=KEY)}))
        failed, errors = reported_within(decode, "d-1", 10)
        assert not failed and not errors
        received = list({id(t): t for t in destination.values()}.values())
        for index, (mine, theirs) in enumerate(zip(tensors, received, strict=True)):
            for dst, src in ((4, 1), (5, 2), (1, 3)):
                assert torch.equal(theirs[dst], mine[src]), (index, dst, src)
            for canary in (0, 2, 3):
                assert bool((theirs[canary] == 0).all()), (index, canary)
    finally:
        prefill.shutdown()
        decode.shutdown()
