"""The shared-memory files kvray makes for KV caches (`kvray.memory.create_shm_buffer`): sized
and mapped through the descriptor that created them, never by a name that may have changed, and
swept once their owner is gone, SIGKILLed or not, whatever children it forked."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvray.memory as memory
from kvray.owned import read_seal, remove_owned, remove_stale_shm_files, seal_owned_file

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


def test_a_seal_follows_the_data_and_replaces_the_one_before(tmp_path: Path) -> None:
    path, buffer = memory.create_shm_buffer(str(tmp_path), NBYTES)
    buffer[:] = 0x5A
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_seal(fd, os.fstat(fd).st_size) is None
        seal_owned_file(path, b"a first, longer seal")
        assert read_seal(fd, os.fstat(fd).st_size) == (b"a first, longer seal", NBYTES)
        seal_owned_file(path, b"second")
        assert read_seal(fd, os.fstat(fd).st_size) == (b"second", NBYTES)
        assert os.pread(fd, NBYTES, 0) == b"\x5a" * NBYTES  # the data never moves
    finally:
        os.close(fd)
        remove_owned(path)


# ---- a KV cache file outlives no owner ---------------------------------------------------------


_OWNER = textwrap.dedent(
    """
    import multiprocessing, sys, time
    from kvray.memory import create_shm_buffer

    path, buffer = create_shm_buffer(sys.argv[1], 1 << 16)
    buffer[:] = 1
    helper = 0
    if sys.argv[2] == "fork":  # e.g. a compile or data-loader worker, forked and never exec'd
        process = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
        process.start()
        helper = process.pid
    print(path, helper, flush=True)
    sys.stdin.read()
    """
)


@contextlib.contextmanager
def kv_cache_owner(folder: str, helper: str) -> Iterator[tuple[subprocess.Popen[str], str, int]]:
    """A process holding a KV cache file it made in `folder` (and, with `helper="fork"`, a
    forked child that outlives it): the process, the file and the child's pid (0: none)."""
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, folder, helper],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = 0
    try:
        assert owner.stdout is not None
        path, pid = owner.stdout.readline().split()
        child = int(pid)
        yield owner, path, child
    finally:
        owner.kill()
        owner.wait(timeout=60)
        for pipe in (owner.stdin, owner.stdout):
            if pipe is not None:
                pipe.close()
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("helper", ["none", "fork"])
def test_a_sigkilled_owners_kv_cache_file_is_swept_and_a_live_ones_kept(tmp_path: Path, helper: str) -> None:
    folder = str(tmp_path)
    with (
        kv_cache_owner(folder, helper) as (live, kept, _),
        kv_cache_owner(folder, helper) as (killed, gone, _),
    ):
        assert remove_stale_shm_files(folder) == []
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)
        assert os.path.exists(gone), "nothing ran at the owner's exit"
        # Its forked child (if any) lives on, holding a copy of every descriptor the owner had.
        assert remove_stale_shm_files(folder) == [gone]
        assert os.path.exists(kept) and live.poll() is None
        # Any later kvray file made in the folder sweeps the same way.
        path, _ = memory.create_shm_buffer(folder, 4096)
        remove_owned(path)
        assert os.path.exists(kept)
