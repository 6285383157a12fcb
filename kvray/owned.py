"""What kvray owns in the shared-memory folder (`Settings.shm_dir`): the files that hold shared
backings (`kvray.memory`) and the private folders that hold completion inboxes and claim boards
(`kvray.notice.local`, `kvray.notice.claims`). Each is named `kvray-<pid>-<random>`, created
here, locked by its creator for as long as it exists, and removed here: by its owner
(`remove_owned`, or at exit), or by anyone once its owner is gone (`remove_stale_shm_files`).

A path a peer publishes is only a claim: `open_peer` is the one place that decides whether it
names one of these entries (of this user, never through a symbolic link), and a file is trusted
only for what its owner sealed it to hold (`seal_owned_file`, `read_seal`).
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import errno
import fcntl
import os
import re
import secrets
import shutil
import stat
import struct
import threading

from kvray.errors import MetadataError, RegionError, TransportError

SHM_PREFIX = "kvray-"
#: Names kvray gives its shared-memory files and completion-inbox folders: prefix, creator's
#: pid (for people reading a listing; liveness is proven by a lock, not by the pid), random part.
_OWNED_NAME = re.compile(rf"{re.escape(SHM_PREFIX)}[0-9]+-[0-9a-z_]+", re.ASCII)


def is_owned_name(name: str) -> bool:
    """Whether `name` is one kvray gives the files and folders it creates in the shared-memory
    folder: a peer's published path is refused unless it names one (`open_peer`)."""
    return _OWNED_NAME.fullmatch(name) is not None


#: A completion inbox's name inside its engine's private folder.
INBOX_NAME = "inbox.sock"
#: A claim board's name inside its engine's private folder.
BOARD_NAME = "claims"
#: A prefill engine's native hand-off lane (`kvray.agent.lane`), beside its push-request inbox.
LANE_NAME = "lane.sock"


class PeerPath(enum.Enum):
    """What a path a peer publishes may name, each where kvray puts it in `shm_dir`."""

    #: A shared backing: `<shm_dir>/kvray-<pid>-<random>`, a regular file, opened to write.
    SHARED_FILE = "shared-memory file"
    #: A completion inbox: `<shm_dir>/<kvray folder>/inbox.sock`, a socket.
    INBOX = "completion inbox"
    #: A claim board: `<shm_dir>/<kvray folder>/claims`, a regular file, opened to read.
    CLAIM_BOARD = "claim board"
    #: A hand-off lane: `<shm_dir>/<kvray folder>/lane.sock`, a socket.
    LANE = "hand-off lane"


# O_NONBLOCK everywhere: opening a FIFO planted under a kvray name must not wait for a writer.
_PEER_FLAGS = {
    PeerPath.SHARED_FILE: os.O_RDWR | os.O_NONBLOCK,
    PeerPath.CLAIM_BOARD: os.O_RDONLY | os.O_NONBLOCK,
    # A socket cannot be opened to read or write; a path descriptor is enough to check it.
    PeerPath.INBOX: os.O_PATH,
    PeerPath.LANE: os.O_PATH,
}
_PEER_NAMES = {PeerPath.INBOX: INBOX_NAME, PeerPath.CLAIM_BOARD: BOARD_NAME, PeerPath.LANE: LANE_NAME}
_SOCKETS = (PeerPath.INBOX, PeerPath.LANE)


def open_peer(path: str, kind: PeerPath, shm_dir: str, *, named_by: str = "a peer", **facts: object) -> int:
    """A descriptor (close-on-exec; the caller closes it) of the `kind` entry a peer published
    at `path`, after the one check every such path gets: it lies where kvray puts a `kind` in
    `shm_dir`, under a name kvray gives, no part of it is a symbolic link, and it is a `kind`
    of this user (a private folder of this user, for an entry inside one). `MetadataError` if
    not (kvray did not make it), `TransportError` if it is gone or cannot be opened.
    `named_by` says who published it (`engine 'd' region 0`), `facts` go with the error."""
    folder = os.path.normpath(shm_dir)
    what = f"{named_by} names {path!r}"
    facts = {"path": path, **facts}
    name = _PEER_NAMES.get(kind)
    # The entry kvray made directly in the folder: the file itself, or the private folder holding it.
    entry = path if name is None else os.path.dirname(path)
    owned = os.path.basename(entry)
    placed = is_owned_name(owned) and path == os.path.join(folder, owned, *([name] if name else []))
    if not placed:
        raise MetadataError(
            f"{what}, which is not a kvray {kind.value} in {folder} (KVRAY_SHM_DIR); kvray uses only "
            f"the {kind.value}s it creates, and both engines need the same shm_dir",
            **facts,
        )
    folder_fd = -1
    fd = -1
    try:
        if name is not None:
            folder_fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            folder_status = os.fstat(folder_fd)
            if folder_status.st_uid != os.geteuid() or folder_status.st_mode & 0o077:
                raise MetadataError(
                    f"{what}, in a folder that is not private to this user; kvray uses only the "
                    f"{kind.value}s it creates",
                    **facts,
                )
        flags = _PEER_FLAGS[kind] | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags) if name is None else os.open(name, flags, dir_fd=folder_fd)
        status = os.fstat(fd)
    except FileNotFoundError as error:
        _close(fd)
        gone = f"the {kind.value} {path} is gone: its engine closed or died (or runs on another node)"
        raise TransportError(gone, **facts) from error
    except OSError as error:
        _close(fd)
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise MetadataError(
                f"{what}, a symbolic link; kvray uses only the {kind.value}s it creates", **facts
            ) from None
        raise TransportError(
            f"cannot open the {kind.value} {path}: {error}; both engines must be on one node and "
            "run as one user",
            **facts,
        ) from error
    except BaseException:
        _close(fd)
        raise
    finally:
        _close(folder_fd)
    wanted = stat.S_ISSOCK if kind in _SOCKETS else stat.S_ISREG
    if not wanted(status.st_mode) or status.st_uid != os.geteuid():
        os.close(fd)
        shape = "socket" if kind in _SOCKETS else "regular file"
        raise MetadataError(
            f"{what}, which is not a {shape} of this user (a symbolic link, or someone else's); "
            f"kvray uses only the {kind.value}s it creates",
            **facts,
        )
    return fd


def _close(fd: int) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)


# # Each file or folder kvray makes in the shared-memory folder is locked (flock, exclusive) by
# its owner for as long as it exists. The kernel drops the lock when the owner dies, in any pid
# namespace, so a lock that can be taken is the proof that the owner is gone; a pid is not (a
# process of another container sharing /dev/shm has a pid this one cannot see, or sees as
# someone else's). The lock belongs to the open file, not to a descriptor: only the descriptor
# that made an entry holds it (`open_owned_file` opens the file anew, so mappings do not), and a
# forked child closes its copy at once (`_disown_in_child`).

#: Path -> (locked descriptor, pid of the process that made it).
_OWNED: dict[str, tuple[int, int]] = {}
#: Path -> where the data of a file this process sealed ends (and its seal begins).
_SEALED: dict[str, int] = {}
_OWNED_LOCK = threading.Lock()


def _disown_in_child() -> None:
    """In a child forked without exec (a multiprocessing worker, a compile pool): the entries
    stay the parent's. The lock belongs to the open file, which the child's copies of the
    descriptors share, so a child that kept them would keep a SIGKILLed parent's files alive
    (unswept) for as long as it lives."""
    for fd, _ in _OWNED.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _OWNED.clear()
    _SEALED.clear()
    _OWNED_LOCK.release()


# Held across the fork, so the child inherits the table whole, never half-updated.
os.register_at_fork(
    before=_OWNED_LOCK.acquire, after_in_parent=_OWNED_LOCK.release, after_in_child=_disown_in_child
)


def _create_owned(shm_dir: str, folder: bool) -> str:
    """Make a fresh `kvray-<pid>-<random>` file (mode 0600, empty) or folder (mode 0700) in
    `shm_dir`, locked by this process before it can be seen under that name: it is made under a
    hidden name, locked, then renamed."""
    remove_stale_shm_files(shm_dir)
    token = secrets.token_hex(8)
    hidden = os.path.join(shm_dir, f".{SHM_PREFIX}new-{os.getpid()}-{token}")
    path = os.path.join(shm_dir, f"{SHM_PREFIX}{os.getpid()}-{token}")
    fd = -1
    try:
        if folder:
            os.mkdir(hidden, 0o700)
            fd = os.open(hidden, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        else:
            fd = os.open(hidden, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.fchmod(fd, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.path.lexists(path):  # a rename would replace it (64 random bits: never, in practice)
            raise FileExistsError(path)
        os.rename(hidden, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            if folder:
                os.rmdir(hidden)
            else:
                os.unlink(hidden)
        if fd >= 0:
            os.close(fd)
        raise RegionError(
            f"cannot create a shared-memory {'folder' if folder else 'file'} in {shm_dir}: {error}; "
            "set KVRAY_SHM_DIR to a writable tmpfs",
            path=path,
        ) from error
    with _OWNED_LOCK:
        _OWNED[path] = (fd, os.getpid())
    return path


def create_owned_file(shm_dir: str) -> str:
    """A fresh private file (mode 0600, empty) in `shm_dir`, kept until `remove_owned` or this
    process's exit, and never swept while this process lives."""
    return _create_owned(shm_dir, folder=False)


def create_owned_folder(shm_dir: str) -> str:
    """A fresh private folder (mode 0700) in `shm_dir`, kept until `remove_owned` or this
    process's exit, and never swept while this process lives."""
    return _create_owned(shm_dir, folder=True)


def open_owned_file(path: str) -> int:
    """A new read-write descriptor (close-on-exec) of the file `create_owned_file` made at
    `path` in this process, opened through the descriptor that made it, never by name: a name
    can be made to name another file after it was created, a descriptor cannot. It is an open
    file of its own, not a duplicate, so neither it nor a mapping made through it holds the
    file's lock. The caller closes it."""
    # Under the lock: `remove_owned` cannot close the descriptor (and its number be reused).
    with _OWNED_LOCK:
        owned = _OWNED.get(path)
        if owned is None or owned[1] != os.getpid():
            raise RegionError(f"{path} is not a shared-memory file this process made and owns", path=path)
        try:
            return os.open(f"/proc/self/fd/{owned[0]}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as error:
            raise RegionError(f"cannot open the shared-memory file {path}: {error}", path=path) from error


# # A seal is what a file's owner says the file is for (the shm transport: which engine
# incarnation's region it holds), written after the file's data by the owner alone, so a peer's
# published description cannot claim another engine's file: it would have to write into it.
# The file ends with the seal, the seal's length and `_SEAL_MAGIC`; the data before it never
# moves, and sealing again replaces the seal.

#: The last bytes of a sealed file.
_SEAL_MAGIC = b"kvray-seal\x00\x01"
#: The seal's length (little-endian) and `_SEAL_MAGIC`.
_SEAL_TAIL = struct.Struct(f"<I{len(_SEAL_MAGIC)}s")
#: The longest seal a file may carry.
MAX_SEAL_BYTES = 4096


def seal_owned_file(path: str, seal: bytes) -> None:
    """Write `seal` after the data of the file `create_owned_file` made at `path` in this
    process (through its own descriptor), replacing any seal written before. The data is what
    the file held when first sealed; it never moves or shrinks."""
    if not 0 < len(seal) <= MAX_SEAL_BYTES:
        raise RegionError(f"a seal holds 1 to {MAX_SEAL_BYTES} bytes, not {len(seal)}", path=path)
    tail = seal + _SEAL_TAIL.pack(len(seal), _SEAL_MAGIC)
    fd = open_owned_file(path)
    try:
        with _OWNED_LOCK:
            data_end = _SEALED.get(path)
            if data_end is None:
                data_end = os.fstat(fd).st_size
            os.ftruncate(fd, data_end + len(tail))
            os.pwrite(fd, tail, data_end)
            _SEALED[path] = data_end
    except OSError as error:
        raise RegionError(f"cannot seal the shared-memory file {path}: {error}", path=path) from error
    finally:
        os.close(fd)


def read_seal(fd: int, size: int) -> tuple[bytes, int] | None:
    """The seal of an open file of `size` bytes (`seal_owned_file`) and where the file's data
    ends; None if it carries none."""
    if size < _SEAL_TAIL.size:
        return None
    length, magic = _SEAL_TAIL.unpack(os.pread(fd, _SEAL_TAIL.size, size - _SEAL_TAIL.size))
    data_end = size - _SEAL_TAIL.size - length
    if magic != _SEAL_MAGIC or not 0 < length <= MAX_SEAL_BYTES or data_end < 0:
        return None
    seal = os.pread(fd, length, data_end)
    return (seal, data_end) if len(seal) == length else None


def remove_owned(path: str) -> None:
    """Remove a file or folder made by `_create_owned`, then release its lock (in that order: an
    unlocked entry is fair game for a sweeper)."""
    with _OWNED_LOCK:
        owned = _OWNED.pop(path, None)
        _SEALED.pop(path, None)
    if owned is None:
        return
    fd, creator = owned
    if creator == os.getpid():  # a child forked past Python's fork hooks owns nothing
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    os.close(fd)


def remove_stale_shm_files(shm_dir: str = "/dev/shm") -> list[str]:
    """Remove the kvray files and inbox folders in `shm_dir` whose owner is gone; return them.

    An entry goes only if its name is one kvray gives, it belongs to this user, it is a regular
    file or a folder (never a symbolic link), and its owner's lock can be taken without waiting
    (the owner's process has ended). The lock is held while it is removed.
    """
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    uid = os.geteuid()
    for name in names:
        if not _OWNED_NAME.fullmatch(name):
            continue
        path = os.path.join(shm_dir, name)
        try:
            status = os.lstat(path)
        except OSError:
            continue
        is_folder = stat.S_ISDIR(status.st_mode)
        if status.st_uid != uid or not (is_folder or stat.S_ISREG(status.st_mode)):
            continue
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(path, flags | (os.O_DIRECTORY if is_folder else 0))
        except OSError:
            continue
        try:
            if not os.path.samestat(status, os.fstat(fd)):
                continue  # replaced since it was looked at
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its owner lives
            if not os.path.samestat(status, os.lstat(path)):
                continue
            if is_folder:
                shutil.rmtree(path)  # a dead decode engine's completion inbox
            else:
                os.unlink(path)
            removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


@atexit.register
def _remove_own_shm_files() -> None:
    with _OWNED_LOCK:
        paths = list(_OWNED)
    for path in paths:
        remove_owned(path)
