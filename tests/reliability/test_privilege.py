"""Least privilege: the prefill side exposes nothing a peer can write; shared-memory files are
private (0600, in a 0700 inbox folder for completions) and are gone after close, and after their
owner is killed (the next start on the node sweeps them); no control-plane path unpickles bytes
from a peer (msgspec only; Ray's own task arguments aside)."""

from __future__ import annotations

import ast
import asyncio
import os
import pickle
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from process_probes import pid_gone, wait_until

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.coordinator import Coordinator, get_or_create_coordinator
from kvray.errors import MetadataError, WireDecodeError
from kvray.layout import BlockOrder, mixed
from kvray.notice.local import ENDPOINT
from kvray.notice.tcp import (
    ADDRESS_ENDPOINT,
    KEY_ENDPOINT,
    NoticeConnection,
    Verdict,
    parse_address,
    parse_key,
)
from kvray.owned import SHM_PREFIX
from kvray.wire import (
    EngineInfo,
    Reservation,
    Role,
    WriteOps,
    decode_engine_info,
    decode_notice,
    decode_write_ops,
    encode,
)
from kvray.workers import DecodeActor, PrefillActor

KVRAY = Path(__file__).resolve().parents[2] / "kvray"
SETTINGS = Settings(coordinator_name="kvray-coordinator-privilege", lookup_timeout_s=5.0)


def _info(engine_id: str) -> EngineInfo:
    coordinator = get_or_create_coordinator(SETTINGS)
    return decode_engine_info(ray.get(coordinator.lookup.remote(engine_id, 10.0))[0])


def test_prefill_exposes_no_writable_region(local_ray: None, figures: Callable[[str], None]) -> None:
    layout = mixed(8, BlockOrder.LAYER_MAJOR)
    prefill = PrefillActor.remote("priv-p", layout, SETTINGS)
    other = PrefillActor.remote("priv-p2", layout, SETTINGS)
    ray.get([prefill.start.remote(), other.start.remote()])
    info = _info("priv-p")
    assert info.regions and not any(region.remote_writable for region in info.regions)
    assert all(region.handle == b"" for region in info.regions), "a prefill backing is in a shared file"
    assert info.endpoints == {}, "a prefill engine takes no completions (no inbox, no notice listener)"
    ray.get(prefill.fill_region.remote(3))
    before = ray.get(prefill.snapshot.remote())[0][1]

    # Another engine pushing into it (a reservation made up, since a prefill engine makes
    # none) is refused before planning.
    ray.get(other.allocate.remote("r", 2))
    made_up = Reservation(
        request_id="r", engine_id="priv-p", incarnation=info.incarnation, blocks=(0, 1), token=1
    )
    with pytest.raises(MetadataError, match="no writable region"):
        ray.get(other.push.remote(made_up))
    # A well-formed write sent straight to its actor is refused by the receiving side too.
    header = WriteOps(
        transfer_id="forged",
        dst_engine="priv-p",
        dst_incarnation=info.incarnation,
        regions=[0],
        remote_offsets=[0],
        nbytes=[64],
        request_id="r",
        token=made_up.token,
    )
    with pytest.raises(MetadataError, match="not a decode engine"):
        ray.get(prefill.kvray_deliver.remote(encode(header), np.full(64, 7, dtype=np.uint8)))
    assert np.array_equal(before, ray.get(prefill.snapshot.remote())[0][1])
    assert ray.get(other.free_count.remote()) == 8
    figures(
        f"[kvray privilege] prefill engine: {len(info.regions)} region(s), 0 remotely writable, no shared "
        "file, no completion inbox or notice listener; a push into it and a forged write to its actor "
        "were refused, 0 bytes changed"
    )
    for actor in (prefill, other):
        ray.kill(actor)


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_shm_files_are_private_and_removed(workers_by_value: Any, figures: Callable[[str], None]) -> None:
    layout = mixed(8, BlockOrder.BLOCK_MAJOR)
    plain = ray.remote(workers_by_value.PlainDecode)
    closing = plain.remote("priv-d-close", layout, SETTINGS)
    ray.get(closing.start.remote())
    info = _info("priv-d-close")
    path, inbox = info.regions[0].handle.decode(), info.endpoints[ENDPOINT]
    folder = os.path.dirname(inbox)
    assert os.path.basename(path).startswith(SHM_PREFIX)
    assert (_mode(path), os.stat(path).st_uid) == (0o600, os.getuid())
    assert _mode(folder) == 0o700 and stat.S_ISSOCK(os.stat(inbox).st_mode)
    ray.get(closing.close.remote())
    assert not os.path.exists(path) and not os.path.exists(folder), "close() left shared files behind"

    killed = plain.remote("priv-d-killed", layout, SETTINGS)
    ray.get(killed.start.remote())
    pid = ray.get(killed.pid.remote())
    info = _info("priv-d-killed")
    left_path, left_folder = info.regions[0].handle.decode(), os.path.dirname(info.endpoints[ENDPOINT])
    ray.kill(killed)
    wait_until(lambda: pid_gone(pid), what="the killed decode reaped")
    assert os.path.exists(left_path), "expected a SIGKILLed engine to leave its file (nothing ran at exit)"
    successor = DecodeActor.remote("priv-d-next", layout, SETTINGS)  # any start on this node sweeps
    ray.get(successor.start.remote())
    assert not os.path.exists(left_path) and not os.path.exists(left_folder), (
        "the next start on the node did not remove a dead engine's shared memory"
    )
    own = _info("priv-d-next").regions[0].handle.decode()
    assert os.path.exists(own) and _mode(own) == 0o600
    figures(
        "[kvray privilege] shm: backing files 0600 and inbox folders 0700, owned by this user; removed by "
        "close(); a SIGKILLed engine's file and inbox removed by the next start on the node"
    )
    ray.kill(successor)


# ---- no pickle on the control plane -----------------------------------------------------------

#: Modules that turn bytes into arbitrary objects, and calls that do.
UNPICKLING_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
UNPICKLING_CALLS = {"loads", "load", "Unpickler", "eval", "exec"}


def _unpickling_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            names = []
        for name in names:
            if set(name.split(".")) & UNPICKLING_MODULES:
                found.append(f"{path.name}:{node.lineno} imports {name}")
        if isinstance(node, ast.Call):
            function = node.func
            called = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
            owner = function.value if isinstance(function, ast.Attribute) else None
            owner_name = getattr(owner, "id", getattr(owner, "attr", ""))
            if called in {"eval", "exec"} and owner is None:
                found.append(f"{path.name}:{node.lineno} calls {called}")
            if called in UNPICKLING_CALLS and owner_name in {"torch", "np", "numpy", *UNPICKLING_MODULES}:
                found.append(f"{path.name}:{node.lineno} calls {owner_name}.{called}")
    return found


class _Marker:
    """Unpickling this creates a file: proof that some path unpickled peer bytes."""

    path = ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.path),))


async def test_no_control_plane_path_unpickles_peer_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, figures: Callable[[str], None]
) -> None:
    sources = sorted(KVRAY.rglob("*.py"))
    uses = [use for path in sources for use in _unpickling_uses(path)]
    assert uses == [], f"kvray code that can unpickle: {uses}"

    unpickled: list[str] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        unpickled.append(repr(args)[:80])
        raise AssertionError("kvray unpickled bytes from a peer")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    marker = tmp_path / "unpickled"
    _Marker.path = str(marker)
    payload = pickle.dumps(_Marker())

    refused = 0
    for decode in (decode_notice, decode_write_ops, decode_engine_info):
        with pytest.raises(WireDecodeError):
            decode(payload)
        refused += 1
    with pytest.raises(WireDecodeError):
        await Coordinator().register(payload, None, b"registrant secret of 32 bytes...")
    refused += 1
    agent = KVAgent(
        "priv-local",
        Role.DECODE,
        mixed(4),
        settings=Settings(shm_dir=str(tmp_path), notice_host="127.0.0.1"),
        use_coordinator=False,
    )
    await agent.start()
    try:
        with pytest.raises(WireDecodeError):
            await agent.notify(payload)
        with pytest.raises(WireDecodeError):
            await agent.deliver(payload, np.zeros(8, dtype=np.uint8))
        refused += 2
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.sendto(payload, agent.info.endpoints[ENDPOINT])
        for _ in range(200):
            if agent.stats["messages_dropped_malformed"] == 2:
                break
            await asyncio.sleep(0.01)
        assert agent.stats["messages_dropped_malformed"] == 2, dict(agent.stats)  # notify, socket
        refused += 1
        # The notice listener, from a writer holding the engine's key: refused as malformed too.
        host, port = parse_address(agent.info.endpoints[ADDRESS_ENDPOINT])
        channel = await NoticeConnection.open(
            host, port, parse_key(agent.info.endpoints[KEY_ENDPOINT]), "priv"
        )
        assert await channel.send(payload) is Verdict.MALFORMED
        channel.close()
        assert agent.stats["messages_dropped_malformed"] == 3, dict(agent.stats)
        refused += 1
    finally:
        await agent.close()
    assert not marker.exists() and unpickled == []
    figures(
        f"[kvray privilege] control plane: {len(sources)} kvray modules scanned, 0 imports or calls that "
        f"unpickle; a pickled payload sent to {refused} peer-facing entry points (message and engine-info "
        "decoding, coordinator registration, notify, deliver, completion socket, notice listener) was "
        "refused as "
        "malformed, never unpickled"
    )
