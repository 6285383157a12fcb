"""The shared-memory files kvray makes for KV caches (`kvray.memory.create_shm_buffer`): sized
and mapped through the descriptor that created them, never by a name that may have changed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import kvray.memory as memory
from kvray.owned import remove_owned

NBYTES = 3 * 4096


def test_a_shm_buffer_is_sized_and_mapped_through_its_descriptor_not_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "shm"
    folder.mkdir()
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"someone else's")
    created: list[tuple[str, int]] = []
    create_owned_file = memory.create_owned_file

    def create_then_swap(shm_dir: str) -> str:
        """The file is made, then another file of this user takes its name."""
        path = create_owned_file(shm_dir)
        created.append((path, os.open(path, os.O_RDONLY)))
        os.rename(decoy, path)
        return path

    monkeypatch.setattr(memory, "create_owned_file", create_then_swap)
    path, buffer = memory.create_shm_buffer(str(folder), NBYTES)
    (made, made_fd) = created[0]
    try:
        assert path == made and buffer.numel() == NBYTES and bool((buffer == 0).all())
        buffer[:] = 0x5A
        # The file now under the name was neither sized nor written; the one kvray made was.
        assert Path(path).read_bytes() == b"someone else's"
        assert os.fstat(made_fd).st_size == NBYTES
        assert os.pread(made_fd, NBYTES, 0) == b"\x5a" * NBYTES
    finally:
        os.close(made_fd)
        remove_owned(path)
