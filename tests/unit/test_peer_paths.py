"""`kvray.owned.open_peer`: the one rule for a path a peer publishes (a shared-memory file, a
completion inbox, a claim board). It opens only an entry kvray made where it makes them, of this
user, through no symbolic link; everything else is refused before a byte is read or sent."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvray.errors import MetadataError, TransportError
from kvray.owned import (
    BOARD_NAME,
    INBOX_NAME,
    LANE_NAME,
    PeerPath,
    create_owned_file,
    create_owned_folder,
    open_peer,
    remove_owned,
)


def _make(kind: PeerPath, shm_dir: Path) -> tuple[str, list[socket.socket]]:
    """A real entry of `kind` as kvray makes it; the sockets to close afterwards."""
    if kind is PeerPath.SHARED_FILE:
        return create_owned_file(str(shm_dir)), []
    folder = create_owned_folder(str(shm_dir))
    if kind is PeerPath.CLAIM_BOARD:
        path = os.path.join(folder, BOARD_NAME)
        Path(path).write_bytes(b"\0" * 16)
        return path, []
    if kind is PeerPath.LANE:
        path = os.path.join(folder, LANE_NAME)
        lane = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        lane.bind(path)
        return path, [lane]
    path = os.path.join(folder, INBOX_NAME)
    inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    inbox.bind(path)
    return path, [inbox]


@pytest.fixture(params=list(PeerPath), ids=lambda kind: kind.name.lower())
def entry(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[PeerPath, str, Path]]:
    kind: PeerPath = request.param
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    path, sockets = _make(kind, shm_dir)
    yield kind, path, shm_dir
    for sock in sockets:
        sock.close()
    remove_owned(path if kind is PeerPath.SHARED_FILE else os.path.dirname(path))


def test_an_entry_kvray_made_opens(entry: tuple[PeerPath, str, Path]) -> None:
    kind, path, shm_dir = entry
    fd = open_peer(path, kind, str(shm_dir))
    try:
        wanted = stat.S_ISSOCK if kind in (PeerPath.INBOX, PeerPath.LANE) else stat.S_ISREG
        assert wanted(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def test_the_same_entry_seen_from_another_folder_is_refused(entry: tuple[PeerPath, str, Path]) -> None:
    kind, path, shm_dir = entry
    with pytest.raises(MetadataError, match=f"not a kvray {kind.value}") as raised:
        open_peer(path, kind, str(shm_dir.parent), named_by="engine 'd'", engine_id="d")
    assert raised.value.engine_id == "d" and raised.value.path == path


def test_a_name_kvray_does_not_give_is_refused(entry: tuple[PeerPath, str, Path]) -> None:
    kind, path, shm_dir = entry
    renamed = str(shm_dir / "elsewhere" / os.path.basename(path))
    for forged in (renamed, path + ".x", str(shm_dir / ".." / "shm" / os.path.relpath(path, shm_dir))):
        with pytest.raises(MetadataError, match="not a kvray"):
            open_peer(forged, kind, str(shm_dir))


def test_a_symbolic_link_under_a_kvray_name_is_not_followed(entry: tuple[PeerPath, str, Path]) -> None:
    kind, path, shm_dir = entry
    owned = path if kind is PeerPath.SHARED_FILE else os.path.dirname(path)
    moved = owned + "-real"
    os.rename(owned, moved)
    os.symlink(moved, owned)
    try:
        with pytest.raises(MetadataError, match="symbolic link"):
            open_peer(path, kind, str(shm_dir))
    finally:
        os.unlink(owned)
        os.rename(moved, owned)


def test_an_entry_of_another_shape_is_refused(entry: tuple[PeerPath, str, Path]) -> None:
    kind, path, shm_dir = entry
    os.rename(path, path + ".saved")
    os.mkfifo(path, 0o600)
    try:
        with pytest.raises(MetadataError, match=r"not a (socket|regular file) of this user"):
            open_peer(path, kind, str(shm_dir))
    finally:
        os.unlink(path)
        os.rename(path + ".saved", path)


def test_a_folder_others_may_enter_is_refused(entry: tuple[PeerPath, str, Path]) -> None:
    kind, path, shm_dir = entry
    if kind is PeerPath.SHARED_FILE:
        pytest.skip("a shared-memory file lies directly in the shm folder")
    folder = os.path.dirname(path)
    os.chmod(folder, 0o755)
    with pytest.raises(MetadataError, match="not private"):
        open_peer(path, kind, str(shm_dir))


def test_a_gone_entry_is_a_transport_error(entry: tuple[PeerPath, str, Path]) -> None:
    kind, path, shm_dir = entry
    os.rename(path, path + ".saved")
    try:
        with pytest.raises(TransportError, match="is gone"):
            open_peer(path, kind, str(shm_dir))
    finally:
        os.rename(path + ".saved", path)
