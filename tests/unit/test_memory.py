"""Invariant 1: the registered region is aligned, inside the allocation, and covers every view."""

from __future__ import annotations

import itertools
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvray.config import Settings
from kvray.errors import ConfigError, LayoutError, RegionError, UnknownLayerError
from kvray.layout import (
    DTYPE_ITEMSIZE,
    READY_LAYOUTS,
    BlockOrder,
    Geometry,
    KVLayout,
    LayerSpec,
    align_up,
    deepseek_v3,
    llama_gqa,
    mixed,
)
from kvray.memory import TORCH_DTYPES, Backing, MemoryKind, cover_region, place_region
from kvray.owned import SHM_PREFIX, create_owned_folder, remove_owned, remove_stale_shm_files
from kvray.validation import validate_engine_info
from kvray.wire import Role, TransportKind

CANARY = 0xA5
WRITTEN = 0x5A
MiB = 1024 * 1024

alignments = st.integers(12, 21).map(lambda shift: 1 << shift)  # a page .. 2 MiB


def small_layout(num_blocks: int = 3, order: BlockOrder = BlockOrder.LAYER_MAJOR) -> KVLayout:
    """MLA, split K/V and indexer layers of odd sizes, so nothing lines up with a page by luck."""
    return KVLayout(
        layers=(
            LayerSpec(name="mla0", geometry=Geometry(block_size=4, entry_shape=(72,), dtype="bfloat16")),
            LayerSpec(
                name="kv0", geometry=Geometry(block_size=4, entry_shape=(3, 8), dtype="float16", parts=2)
            ),
            LayerSpec(name="mla1", geometry=Geometry(block_size=4, entry_shape=(72,), dtype="bfloat16")),
            LayerSpec(name="idx", geometry=Geometry(block_size=4, entry_shape=(33,), dtype="uint8")),
            LayerSpec(
                name="kv1", geometry=Geometry(block_size=4, entry_shape=(5,), dtype="float32", parts=2)
            ),
        ),
        num_blocks=num_blocks,
        block_order=order,
    )


def view_byte_span(view: torch.Tensor) -> tuple[int, int]:
    """[first, one past last) byte address any element of a strided view touches."""
    assert all(stride >= 0 for stride in view.stride())
    first = view.data_ptr()
    last_element = sum((size - 1) * stride for size, stride in zip(view.shape, view.stride(), strict=True))
    return first, first + (last_element + 1) * view.element_size()


def as_bytes(view: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8 (the last dimension grows by the itemsize)."""
    return view.view(torch.uint8)


# ---- (a) place_region ----------------------------------------------------------------------


def assert_region_inside(span_start: int, span_nbytes: int, alloc_start: int, alloc_nbytes: int) -> None:
    assert span_start >= alloc_start, "region starts before the allocation (negative offset)"
    assert span_start + span_nbytes <= alloc_start + alloc_nbytes, "region ends after the allocation"


@settings(max_examples=300)
@given(
    alloc_start=st.integers(0, 1 << 48),
    needed=st.integers(1, 1 << 36),
    alignment=alignments,
)
@example(alloc_start=0x7F00_0000_0010, needed=8192, alignment=4096)  # the seed fix's crash case
@example(alloc_start=0x7F00_0000_0FFF, needed=4096, alignment=4096)
@example(alloc_start=0x7F00_0000_1000, needed=4096, alignment=4096)  # already aligned
@example(alloc_start=0x7F00_0000_0001, needed=1, alignment=2 * MiB)
def test_place_region_in_enough_memory_always_fits(alloc_start: int, needed: int, alignment: int) -> None:
    alloc_nbytes = align_up(needed, alignment) + alignment
    span = place_region(alloc_start, alloc_nbytes, needed, alignment)
    assert span.start % alignment == 0
    assert span.nbytes % alignment == 0
    assert span.nbytes >= needed
    assert span.offset_in_allocation >= 0
    assert span.offset_in_allocation < alignment
    assert (span.alloc_start, span.alloc_nbytes) == (alloc_start, alloc_nbytes)
    assert_region_inside(span.start, span.nbytes, alloc_start, alloc_nbytes)


@settings(max_examples=300)
@given(
    alloc_start=st.integers(0, 1 << 48),
    needed=st.integers(1, 1 << 36),
    alignment=alignments,
    shortfall=st.integers(1, 1 << 22),
)
def test_place_region_in_too_little_memory_fits_or_refuses(
    alloc_start: int, needed: int, alignment: int, shortfall: int
) -> None:
    alloc_nbytes = max(0, align_up(needed, alignment) + alignment - shortfall)
    try:
        span = place_region(alloc_start, alloc_nbytes, needed, alignment)
    except RegionError:
        return
    assert span.start % alignment == 0 and span.nbytes % alignment == 0
    assert span.nbytes >= needed
    assert_region_inside(span.start, span.nbytes, alloc_start, alloc_nbytes)


def test_page_multiple_size_with_misaligned_base_does_not_crash() -> None:
    # The seed fix crashed at start-up here: 8 pages needed, base 16 bytes past a page.
    base = 0x7F12_3456_7010
    span = place_region(base, 8 * 4096 + 4096, 8 * 4096, 4096)
    assert span.start == 0x7F12_3456_8000
    assert span.nbytes == 8 * 4096
    assert span.end <= base + 9 * 4096


def test_place_region_never_rounds_the_start_down() -> None:
    base = 0x10_0000_0040
    span = place_region(base, 3 * 4096, 4096, 4096)
    assert span.start == 0x10_0000_1000  # align_down(base) would be 64 bytes before the allocation


def test_place_region_with_exactly_aligned_allocation_and_no_slack() -> None:
    span = place_region(0x4000, 0x2000, 0x2000, 4096)
    assert (span.start, span.nbytes) == (0x4000, 0x2000)
    with pytest.raises(RegionError):
        place_region(0x4001, 0x2000, 0x2000, 4096)


@pytest.mark.parametrize(("alloc_start", "needed"), [(0x1000, 0), (0x1000, -4096), (-4096, 4096)])
def test_place_region_refuses_nonsense(alloc_start: int, needed: int) -> None:
    with pytest.raises(RegionError):
        place_region(alloc_start, 1 << 20, needed, 4096)


# ---- (b) cover_region -----------------------------------------------------------------------


@settings(max_examples=300)
@given(
    alloc_start=st.integers(0, 1 << 40),
    alloc_nbytes=st.integers(1, 1 << 24),
    data_offset=st.integers(-(1 << 13), 1 << 24),
    data_nbytes=st.integers(1, 1 << 24),
    alignment=st.integers(12, 16).map(lambda shift: 1 << shift),
)
def test_cover_region_covers_data_inside_allocation_or_refuses(
    alloc_start: int, alloc_nbytes: int, data_offset: int, data_nbytes: int, alignment: int
) -> None:
    data_start = alloc_start + data_offset
    try:
        span = cover_region(alloc_start, alloc_nbytes, data_start, data_nbytes, alignment)
    except RegionError:
        aligned_start = data_start - data_start % alignment
        aligned_end = align_up(data_start + data_nbytes, alignment)
        fits = alloc_start <= aligned_start and aligned_end <= alloc_start + alloc_nbytes
        inside = alloc_start <= data_start and data_start + data_nbytes <= alloc_start + alloc_nbytes
        assert not (fits and inside), "refused a region that fits"
        return
    assert span.start % alignment == 0 and span.nbytes % alignment == 0
    assert span.start <= data_start and data_start + data_nbytes <= span.end
    assert span.end - span.start < data_nbytes + 2 * alignment
    assert_region_inside(span.start, span.nbytes, alloc_start, alloc_nbytes)


def test_cover_region_refuses_misaligned_data_at_the_allocation_start() -> None:
    # The seed fix: a region rounded down from a misaligned base reaches before the allocation.
    with pytest.raises(RegionError) as caught:
        cover_region(0x7000_0040, 4096 * 4, 0x7000_0040, 4096 * 3, 4096)
    assert caught.value.region_start < caught.value.alloc_start


def test_cover_region_refuses_data_outside_the_allocation() -> None:
    with pytest.raises(RegionError):
        cover_region(0x10000, 0x4000, 0xF000, 0x1000, 4096)
    with pytest.raises(RegionError):
        cover_region(0x10000, 0x4000, 0x13000, 0x2000, 4096)
    with pytest.raises(RegionError):
        cover_region(0x10000, 0x4000, 0x11000, 0, 4096)


# ---- (c) in_buffer over a caller's misaligned buffer ----------------------------------------


def check_backing_in_buffer(
    layout: KVLayout, big: torch.Tensor, start: int, stop: int, alignment: int
) -> None:
    """Backing in big[start:stop]: aligned, inside, covering, and writes stay inside the region."""
    big.fill_(CANARY)
    buffer = big[start:stop]
    try:
        backing = Backing.in_buffer(layout, buffer, alignment=alignment)
    except RegionError:
        assert stop - start < align_up(layout.nbytes, alignment) + alignment
        return
    (region,) = backing.regions
    buffer_start, buffer_end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    region_start, region_end = region.address, region.address + region.nbytes
    assert region_start % alignment == 0 and region.nbytes % alignment == 0
    assert buffer_start <= region_start and region_end <= buffer_end
    assert region.tensor.data_ptr() == region_start and region.tensor.numel() == region.nbytes
    assert region.kind is MemoryKind.CPU

    storage_start = big.untyped_storage().data_ptr()
    for name in layout.layer_names:
        view = backing.view(name)
        assert tuple(view.shape) == layout.tensor_shape(name)
        assert view.dtype == TORCH_DTYPES[layout.layer(name).geometry.dtype]
        assert view.untyped_storage().data_ptr() == storage_start, "a view must share the buffer"
        first, last = view_byte_span(view)
        assert region_start <= first and last <= region_end, name
        as_bytes(view).fill_(WRITTEN)

    data = big.numpy()
    region_lo, region_hi = region_start - storage_start, region_end - storage_start
    assert (data[:region_lo] == CANARY).all(), "a view wrote before the region"
    assert (data[region_hi:] == CANARY).all(), "a view wrote after the region"
    written = int((data[region_lo:region_hi] == WRITTEN).sum())
    # Every view byte was written, and no two views share one (else fewer bytes than this).
    assert written == sum(layout.layer_nbytes(name) for name in layout.layer_names)


@settings(max_examples=100)
@given(
    order=st.sampled_from(list(BlockOrder)),
    num_blocks=st.integers(1, 5),
    alignment=st.sampled_from([4096, 8192, 16384]),
    misalignment=st.integers(0, 2 * 16384),
    slack=st.integers(-4096, 4096),
)
def test_in_buffer_region_is_aligned_inside_and_covers_every_view(
    order: BlockOrder, num_blocks: int, alignment: int, misalignment: int, slack: int
) -> None:
    layout = small_layout(num_blocks, order)
    size = max(1, align_up(layout.nbytes, alignment) + alignment + slack)
    big = torch.empty(misalignment + size + 512, dtype=torch.uint8)
    check_backing_in_buffer(layout, big, misalignment, misalignment + size, alignment)


@pytest.mark.parametrize("order", list(BlockOrder))
@pytest.mark.parametrize("name", sorted(READY_LAYOUTS))
@pytest.mark.parametrize("misalignment", [0, 1, 64, 4095, 4097])
def test_in_buffer_ready_layouts(name: str, order: BlockOrder, misalignment: int) -> None:
    layout = READY_LAYOUTS[name](num_blocks=2, block_order=order)
    size = align_up(layout.nbytes, 4096) + 4096
    big = torch.empty(misalignment + size + 4096, dtype=torch.uint8)
    check_backing_in_buffer(layout, big, misalignment, misalignment + size, 4096)


def test_in_buffer_refuses_a_buffer_too_small_to_align() -> None:
    layout = small_layout()
    big = torch.empty(2 * 4096 + align_up(layout.nbytes, 4096), dtype=torch.uint8)
    misaligned = (-big.data_ptr()) % 4096 + 8
    buffer = big[misaligned : misaligned + align_up(layout.nbytes, 4096)]
    with pytest.raises(RegionError):
        Backing.in_buffer(layout, buffer, alignment=4096)


@pytest.mark.parametrize(
    "buffer",
    [
        torch.empty(1 << 16, dtype=torch.float16),
        torch.empty(2, 1 << 15, dtype=torch.uint8),
        torch.empty(1 << 17, dtype=torch.uint8)[::2],
    ],
    ids=["float16", "2-d", "strided"],
)
def test_in_buffer_refuses_a_buffer_that_is_not_flat_bytes(buffer: torch.Tensor) -> None:
    with pytest.raises(RegionError):
        Backing.in_buffer(small_layout(), buffer, alignment=4096)


# ---- (d) allocate: CPU and shared memory ----------------------------------------------------

LAYOUT_ORDER_KIND = [
    pytest.param(name, order, kind, id=f"{name}-{order.value}-{kind.value}")
    for name in sorted(READY_LAYOUTS)
    for order in BlockOrder
    for kind in (MemoryKind.CPU, MemoryKind.SHM)
]


@pytest.mark.parametrize(("name", "order", "kind"), LAYOUT_ORDER_KIND)
def test_allocate_views_have_layer_shapes_and_do_not_alias(
    name: str, order: BlockOrder, kind: MemoryKind, closing: Callable[[Backing], Backing]
) -> None:
    layout = READY_LAYOUTS[name](num_blocks=3, block_order=order)
    backing = closing(Backing.allocate(layout, kind))
    assert backing.kind is kind
    (region,) = backing.regions
    assert region.address % 4096 == 0 and region.nbytes % 4096 == 0
    assert region.nbytes >= layout.nbytes
    assert_region_inside(region.address, region.nbytes, region.span.alloc_start, region.span.alloc_nbytes)
    assert region.span.alloc_nbytes == align_up(layout.nbytes, 4096) + 4096

    for spec in layout.layers:
        view = backing.view(spec.name)
        geometry = spec.geometry
        block_shape = (3, geometry.block_size, *geometry.entry_shape)
        assert tuple(view.shape) == ((2, *block_shape) if geometry.parts == 2 else block_shape)
        assert view.dtype == TORCH_DTYPES[geometry.dtype]
        first, last = view_byte_span(view)
        assert region.address <= first and last <= region.address + region.nbytes

    # Distinct bytes per layer, read back after every layer is written: the seed bug (two
    # layers at one address) would show the later layer's value in the earlier one.
    for index, spec in enumerate(layout.layers):
        as_bytes(backing.view(spec.name)).fill_(index + 1)
    for index, spec in enumerate(layout.layers):
        values = torch.unique(as_bytes(backing.view(spec.name)))
        assert values.tolist() == [index + 1], spec.name
    region_bytes = region.tensor.numpy()
    assert int((region_bytes != 0).sum()) >= sum(layout.layer_nbytes(n) for n in layout.layer_names)


@pytest.mark.parametrize(
    ("name", "shape", "dtype"),
    [
        ("model.layers.0.self_attn.mla", (5, 64, 576), torch.bfloat16),
        ("model.layers.60.self_attn.mla", (5, 64, 576), torch.bfloat16),
        ("model.indexer.k_cache", (5, 64, 132), torch.uint8),
    ],
)
def test_deepseek_view_shapes(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    backing = Backing.allocate(deepseek_v3(num_blocks=5))
    assert tuple(backing.view(name).shape) == shape
    assert backing.view(name).dtype == dtype


def test_llama_view_is_k_and_v() -> None:
    backing = Backing.allocate(llama_gqa(num_blocks=5, num_layers=2))
    view = backing.view("model.layers.1.self_attn.kv")
    assert tuple(view.shape) == (2, 5, 16, 8, 128)
    assert view.dtype == torch.float16
    view[1].fill_(2.0)  # V only
    view[0].fill_(1.0)
    assert bool((view[1] == 2.0).all()), "writing K changed V"


def test_view_of_unknown_layer_raises() -> None:
    backing = Backing.allocate(llama_gqa(num_blocks=2, num_layers=1))
    with pytest.raises(UnknownLayerError):
        backing.view("model.layers.1.self_attn.kv")


@pytest.mark.parametrize("alignment", [8192, 65536])
def test_allocate_uses_the_configured_alignment(alignment: int) -> None:
    layout = small_layout()
    for backing in (
        Backing.allocate(layout, settings=Settings(alignment=alignment)),
        Backing.allocate(layout, alignment=alignment),
    ):
        (region,) = backing.regions
        assert backing.alignment == alignment
        assert region.address % alignment == 0 and region.nbytes % alignment == 0
        assert region.span.alloc_nbytes == align_up(layout.nbytes, alignment) + alignment


def test_cuda_backing_without_cuda_raises_region_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RegionError, match="CUDA"):
        Backing.allocate(small_layout(), MemoryKind.CUDA)


# ---- (e) shared-memory files ----------------------------------------------------------------


def test_shm_file_is_private_named_for_this_process_and_removed_on_close() -> None:
    backing = Backing.allocate(mixed(num_blocks=2), MemoryKind.SHM)
    (region,) = backing.regions
    path = region.shm_path
    assert path is not None
    assert os.path.dirname(path) == "/dev/shm"
    assert re.fullmatch(rf"{SHM_PREFIX}{os.getpid()}-[0-9a-f]{{16}}", os.path.basename(path))
    status = os.stat(path)
    assert status.st_mode & 0o777 == 0o600
    assert status.st_size == region.span.alloc_nbytes
    with Backing.allocate(mixed(num_blocks=2), MemoryKind.SHM) as other:
        assert other.regions[0].shm_path != path
        other_path = other.regions[0].shm_path
    assert other_path is not None and not os.path.exists(other_path)

    backing.close()
    assert backing.closed
    assert not os.path.exists(path)
    backing.close()  # idempotent
    assert not os.path.exists(path)


def test_shm_region_bytes_are_in_the_file_at_the_handle_offset() -> None:
    layout = small_layout()
    with Backing.allocate(layout, MemoryKind.SHM) as backing:
        (region,) = backing.regions
        (descriptor,) = backing.region_descriptors("decode-0", 7, TransportKind.SHM, remote_writable=True)
        pattern = np.random.default_rng(0).integers(0, 256, region.nbytes, dtype=np.uint8)
        region.tensor.copy_(torch.from_numpy(pattern))
        assert descriptor.handle == region.shm_path.encode()  # type: ignore[union-attr]
        fd = os.open(descriptor.handle.decode(), os.O_RDONLY)
        try:
            from_file = os.pread(fd, descriptor.length, descriptor.handle_offset)
        finally:
            os.close(fd)
        assert from_file == pattern.tobytes()


def dead_pid() -> int:
    pid = 2**22 + 12345
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    return pid


def test_remove_stale_shm_files_removes_unlocked_entries_and_keeps_other_names(
    tmp_path: os.PathLike[str],
) -> None:
    folder = str(tmp_path)
    dead = os.path.join(folder, f"{SHM_PREFIX}{dead_pid()}-0123456789abcdef")
    dead_inbox = os.path.join(folder, f"{SHM_PREFIX}{dead_pid()}-fedcba9876543210")
    foreign = os.path.join(folder, f"other-{dead_pid()}-0123456789abcdef")
    not_a_pid = os.path.join(folder, f"{SHM_PREFIX}abc-0123456789abcdef")
    for path in (dead, foreign, not_a_pid):
        with open(path, "wb") as file:
            file.write(b"x")
    os.mkdir(dead_inbox, 0o700)
    with open(os.path.join(dead_inbox, "inbox.sock"), "wb"):
        pass
    assert sorted(remove_stale_shm_files(folder)) == sorted([dead, dead_inbox])
    assert not os.path.exists(dead) and not os.path.exists(dead_inbox)
    for path in (foreign, not_a_pid):
        assert os.path.exists(path)
    assert remove_stale_shm_files(folder) == []


_LOCK_HOLDER = """
import fcntl, os, sys
fds = [os.open(path, os.O_RDONLY) for path in sys.argv[1:]]
for fd in fds:
    fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


def test_remove_stale_shm_files_keeps_a_live_owner_whatever_pid_its_name_shows(
    tmp_path: os.PathLike[str],
) -> None:
    """An owner in another pid namespace has a pid this process sees as dead (or as someone
    else's): its lock, not its pid, keeps its backing file and inbox folder."""
    folder = str(tmp_path)
    backing = os.path.join(folder, f"{SHM_PREFIX}{dead_pid()}-0123456789abcdef")
    inbox = os.path.join(folder, f"{SHM_PREFIX}{dead_pid()}-fedcba9876543210")
    with open(backing, "wb") as file:
        file.write(b"live")
    os.mkdir(inbox, 0o700)
    owner = subprocess.Popen(
        [sys.executable, "-c", _LOCK_HOLDER, backing, inbox],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "locked"
        assert remove_stale_shm_files(folder) == []
        assert os.path.isfile(backing) and os.path.isdir(inbox)
    finally:
        owner.communicate("", timeout=60)
    assert sorted(remove_stale_shm_files(folder)) == sorted([backing, inbox])


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can make another user's file")
def test_remove_stale_shm_files_never_removes_another_users_entries(tmp_path: os.PathLike[str]) -> None:
    folder = str(tmp_path)
    theirs = os.path.join(folder, f"{SHM_PREFIX}{dead_pid()}-0123456789abcdef")
    their_folder = os.path.join(folder, f"{SHM_PREFIX}{dead_pid()}-fedcba9876543210")
    with open(theirs, "wb") as file:
        file.write(b"x")
    os.mkdir(their_folder)
    os.chown(theirs, 12345, 12345)
    os.chown(their_folder, 12345, 12345)
    assert remove_stale_shm_files(folder) == []
    assert os.path.exists(theirs) and os.path.exists(their_folder)


def test_remove_stale_shm_files_never_follows_a_symbolic_link(tmp_path: os.PathLike[str]) -> None:
    folder = os.path.join(str(tmp_path), "shm")
    os.mkdir(folder)
    target_file = os.path.join(str(tmp_path), "precious")
    target_folder = os.path.join(str(tmp_path), "precious-folder")
    with open(target_file, "wb") as file:
        file.write(b"x")
    os.mkdir(target_folder)
    link = os.path.join(folder, f"{SHM_PREFIX}{dead_pid()}-0123456789abcdef")
    folder_link = os.path.join(folder, f"{SHM_PREFIX}{dead_pid()}-fedcba9876543210")
    os.symlink(target_file, link)
    os.symlink(target_folder, folder_link)
    assert remove_stale_shm_files(folder) == []
    assert os.path.islink(link) and os.path.islink(folder_link)
    assert os.path.exists(target_file) and os.path.isdir(target_folder)


def test_owned_entries_are_locked_from_the_moment_they_have_their_name(tmp_path: os.PathLike[str]) -> None:
    """Files and inbox folders this process makes survive a sweep (even a sweep that runs the
    pid check in another namespace) until they are removed."""
    folder = str(tmp_path)
    inbox = create_owned_folder(folder)
    with Backing.allocate(small_layout(), MemoryKind.SHM, settings=Settings(shm_dir=folder)) as backing:
        path = backing.regions[0].shm_path
        assert path is not None
        assert sorted(os.listdir(folder)) == sorted([os.path.basename(path), os.path.basename(inbox)])
        assert remove_stale_shm_files(folder) == []
        assert os.stat(inbox).st_mode & 0o777 == 0o700
    remove_owned(inbox)
    assert os.listdir(folder) == []


def test_remove_stale_shm_files_in_dev_shm_keeps_open_backings() -> None:
    dead = f"/dev/shm/{SHM_PREFIX}{dead_pid()}-unit{secrets.token_hex(6)}"
    with open(dead, "wb") as file:
        file.write(b"x")
    try:
        with Backing.allocate(small_layout(), MemoryKind.SHM) as backing:
            live = backing.regions[0].shm_path
            assert live is not None
            assert not os.path.exists(dead), "allocating a shared backing should sweep stale files"
            assert live not in remove_stale_shm_files()
            assert os.path.exists(live)
    finally:
        if os.path.exists(dead):
            os.unlink(dead)


def test_allocate_shm_in_configured_folder(tmp_path: os.PathLike[str]) -> None:
    stale = os.path.join(str(tmp_path), f"{SHM_PREFIX}{dead_pid()}-feedfacefeedface")
    with open(stale, "wb") as file:
        file.write(b"x")
    with Backing.allocate(
        small_layout(), MemoryKind.SHM, settings=Settings(shm_dir=str(tmp_path))
    ) as backing:
        path = backing.regions[0].shm_path
        assert path is not None and os.path.dirname(path) == str(tmp_path)
        assert os.listdir(str(tmp_path)) == [os.path.basename(path)]
    assert os.listdir(str(tmp_path)) == []


def test_allocate_shm_in_missing_folder_raises_region_error(tmp_path: os.PathLike[str]) -> None:
    missing = os.path.join(str(tmp_path), "nope")
    with pytest.raises(RegionError, match="KVRAY_SHM_DIR"):
        Backing.allocate(small_layout(), MemoryKind.SHM, settings=Settings(shm_dir=missing))


@pytest.mark.parametrize("pid_text", [str(10**20), "\u00b2"], ids=["huge", "superscript-two"])
def test_stale_sweep_survives_a_file_named_with_a_bogus_pid(
    tmp_path: os.PathLike[str], pid_text: str
) -> None:
    bogus = os.path.join(str(tmp_path), f"{SHM_PREFIX}{pid_text}-0123456789abcdef")
    with open(bogus, "wb") as file:
        file.write(b"x")
    remove_stale_shm_files(str(tmp_path))
    with Backing.allocate(small_layout(), MemoryKind.SHM, settings=Settings(shm_dir=str(tmp_path))):
        pass


# ---- (f) adopt: the caller's own per-layer tensors -----------------------------------------


def padded_layer_tensors(layout: KVLayout, alignment: int, misalignment: int) -> dict[str, torch.Tensor]:
    """Per-layer tensors inside storages padded by `alignment` on both sides, starting
    `misalignment` bytes past an aligned address."""
    tensors = {}
    for name in layout.layer_names:
        nbytes = layout.layer_nbytes(name)
        storage = torch.full((nbytes + 3 * alignment,), CANARY, dtype=torch.uint8)
        start = (-storage.data_ptr()) % alignment + alignment + misalignment
        dtype = TORCH_DTYPES[layout.layer(name).geometry.dtype]
        tensors[name] = storage[start : start + nbytes].view(dtype).view(layout.tensor_shape(name))
    return tensors


@pytest.mark.parametrize("misalignment", [0, 64, 2048])
@pytest.mark.parametrize("name", sorted(READY_LAYOUTS))
def test_adopt_registers_one_region_per_layer_inside_its_storage(
    name: str, misalignment: int, make_info: Callable[..., object]
) -> None:
    layout = READY_LAYOUTS[name](num_blocks=2)
    tensors = padded_layer_tensors(layout, 4096, misalignment)
    backing = Backing.adopt(layout, tensors, alignment=4096)
    assert len(backing.regions) == len(layout.layers)
    for index, layer in enumerate(layout.layer_names):
        region = backing.regions[index]
        tensor = tensors[layer]
        assert region.index == index
        assert backing.view(layer) is tensor
        storage = tensor.untyped_storage()
        assert region.address % 4096 == 0 and region.nbytes % 4096 == 0
        assert_region_inside(region.address, region.nbytes, storage.data_ptr(), storage.nbytes())
        first, last = view_byte_span(tensor)
        assert region.address <= first and last <= region.address + region.nbytes
        assert region.tensor.data_ptr() == region.address
        assert region.tensor.untyped_storage().data_ptr() == storage.data_ptr()
        placement = backing.placements[layer]
        assert placement.region == index
        assert placement.offset == tensor.data_ptr() - region.address
        assert placement.offset == misalignment
    info = make_info(backing, "prefill-0", 1, Role.PREFILL)
    validate_engine_info(info)  # type: ignore[arg-type]


def test_adopt_region_bytes_are_the_tensor_bytes() -> None:
    layout = small_layout(num_blocks=2)
    tensors = padded_layer_tensors(layout, 4096, 192)
    backing = Backing.adopt(layout, tensors, alignment=4096)
    for name in layout.layer_names:
        placement = backing.placements[name]
        region = backing.regions[placement.region]
        as_bytes(tensors[name]).fill_(WRITTEN)
        nbytes = layout.layer_nbytes(name)
        region_bytes = region.tensor.numpy()
        assert (region_bytes[placement.offset : placement.offset + nbytes] == WRITTEN).all()
        assert int((region_bytes == WRITTEN).sum()) == nbytes
        assert int((region_bytes == CANARY).sum()) == region.nbytes - nbytes


def misaligned_storage_tensor(layout: KVLayout, name: str, keep: list[np.ndarray], tail: int) -> torch.Tensor:
    """A layer tensor whose storage starts at its data, 64 bytes past a page boundary."""
    nbytes = layout.layer_nbytes(name)
    array = np.empty(nbytes + 3 * 4096, dtype=np.uint8)
    keep.append(array)
    start = (-array.ctypes.data) % 4096 + 64
    flat = torch.from_numpy(array[start : start + nbytes + tail])
    assert flat.untyped_storage().data_ptr() == flat.data_ptr()
    assert flat.data_ptr() % 4096 == 64
    dtype = TORCH_DTYPES[layout.layer(name).geometry.dtype]
    return flat[:nbytes].view(dtype).view(layout.tensor_shape(name))


@pytest.mark.parametrize("tail", [0, 8192])
def test_adopt_refuses_a_region_that_would_start_before_the_storage(tail: int) -> None:
    layout = small_layout(num_blocks=2)
    keep: list[np.ndarray] = []
    tensors = padded_layer_tensors(layout, 4096, 0)
    tensors["kv0"] = misaligned_storage_tensor(layout, "kv0", keep, tail)
    with pytest.raises(RegionError) as caught:
        Backing.adopt(layout, tensors, alignment=4096)
    assert caught.value.region_start < caught.value.alloc_start


def test_adopt_refuses_a_region_that_would_end_after_the_storage() -> None:
    layout = small_layout(num_blocks=2)
    tensors = padded_layer_tensors(layout, 4096, 0)
    name = "mla0"
    nbytes = layout.layer_nbytes(name)
    assert nbytes % 4096 != 0
    array = np.empty(nbytes + 2 * 4096, dtype=np.uint8)
    start = (-array.ctypes.data) % 4096
    exact = torch.from_numpy(array[start : start + nbytes])  # aligned start, storage ends mid-page
    assert exact.untyped_storage().nbytes() == nbytes
    assert exact.data_ptr() % 4096 == 0
    tensors[name] = exact.view(torch.bfloat16).view(layout.tensor_shape(name))
    with pytest.raises(RegionError) as caught:
        Backing.adopt(layout, tensors, alignment=4096)
    assert caught.value.region_end > caught.value.alloc_end
    del tensors, exact  # the array must outlive the tensors over it


def test_adopt_refuses_wrong_shape_dtype_contiguity_and_layers() -> None:
    layout = small_layout(num_blocks=2)

    def fresh() -> dict[str, torch.Tensor]:
        return padded_layer_tensors(layout, 4096, 0)

    wrong_shape = fresh()
    wrong_shape["kv0"] = wrong_shape["kv0"][0]
    with pytest.raises(LayoutError) as caught:
        Backing.adopt(layout, wrong_shape, alignment=4096)
    assert caught.value.layer == "kv0"

    wrong_dtype = fresh()
    wrong_dtype["mla0"] = wrong_dtype["mla0"].view(torch.float16)
    with pytest.raises(LayoutError) as caught:
        Backing.adopt(layout, wrong_dtype, alignment=4096)
    assert caught.value.layer == "mla0"

    strided = fresh()
    shape = layout.tensor_shape("idx")
    strided["idx"] = torch.empty((shape[1], shape[0], *shape[2:]), dtype=torch.uint8).transpose(0, 1)
    with pytest.raises(LayoutError, match="contiguous"):
        Backing.adopt(layout, strided, alignment=4096)

    missing = fresh()
    del missing["kv1"]
    with pytest.raises(LayoutError) as caught:
        Backing.adopt(layout, missing, alignment=4096)
    assert caught.value.missing == ["kv1"]

    extra = fresh()
    extra["ghost"] = torch.empty(1, dtype=torch.uint8)
    with pytest.raises(LayoutError) as caught:
        Backing.adopt(layout, extra, alignment=4096)
    assert caught.value.unknown == ["ghost"]


def test_adopt_refuses_block_major_layouts() -> None:
    layout = small_layout(num_blocks=2, order=BlockOrder.BLOCK_MAJOR)
    tensors = padded_layer_tensors(small_layout(num_blocks=2), 4096, 0)
    with pytest.raises(LayoutError, match="layer-major"):
        Backing.adopt(layout, tensors, alignment=4096)


def test_adopt_refuses_two_layers_sharing_memory() -> None:
    layout = llama_gqa(num_blocks=2, num_layers=2)
    tensors = padded_layer_tensors(layout, 4096, 0)
    first, second = layout.layer_names
    tensors[second] = tensors[first]
    with pytest.raises((LayoutError, RegionError)):
        Backing.adopt(layout, tensors, alignment=4096)


# ---- (g) descriptors and engine info --------------------------------------------------------


@pytest.mark.parametrize("kind", [MemoryKind.CPU, MemoryKind.SHM])
@pytest.mark.parametrize("order", list(BlockOrder))
def test_descriptors_and_engine_info_match_the_backing(
    kind: MemoryKind, order: BlockOrder, closing: Callable[[Backing], Backing]
) -> None:
    layout = mixed(num_blocks=3, block_order=order)
    backing = closing(Backing.allocate(layout, kind))
    (region,) = backing.regions
    descriptors = backing.region_descriptors("decode-0", 42, TransportKind.SHM, remote_writable=True)
    (descriptor,) = descriptors
    assert descriptor.engine_id == "decode-0" and descriptor.incarnation == 42
    assert descriptor.transport is TransportKind.SHM
    assert descriptor.index == 0
    assert descriptor.address == 0  # reached by offset: where the memory lies is not published
    assert descriptor.length == region.nbytes
    assert descriptor.handle_offset == region.span.offset_in_allocation
    assert 0 <= descriptor.handle_offset < backing.alignment
    assert descriptor.remote_writable is True
    if kind is MemoryKind.SHM:
        assert descriptor.handle == region.shm_path.encode()  # type: ignore[union-attr]
        assert descriptor.handle_offset + descriptor.length <= os.stat(region.shm_path).st_size  # type: ignore[arg-type]
    else:
        assert descriptor.handle == b""
    readonly = backing.region_descriptors("prefill-0", 1, TransportKind.RAY, remote_writable=False)
    assert readonly[0].remote_writable is False

    info = backing.engine_info("decode-0", 42, Role.DECODE, "node-a", descriptors, {"qp": "17"})
    assert info.regions == descriptors
    assert info.layout == layout
    assert info.placements == layout.placements() == backing.placements
    assert info.endpoints == {"qp": "17"}
    assert (info.role, info.node_id) == (Role.DECODE, "node-a")
    validate_engine_info(info)


@pytest.mark.parametrize("transport", [TransportKind.SHM, TransportKind.RAY, TransportKind.LOOPBACK])
def test_regions_reached_by_offset_publish_no_address(
    transport: TransportKind, closing: Callable[[Backing], Backing]
) -> None:
    """A peer writes a shm region through its file and a ray region through its owner, by offset
    either way: the owner's virtual addresses are not published (address 0), and several such
    regions of one engine are still valid."""
    layout = llama_gqa(num_blocks=4, num_layers=2)
    memory = MemoryKind.SHM if transport is TransportKind.SHM else MemoryKind.CPU
    backings = [closing(Backing.allocate(layout, memory))]
    if memory is MemoryKind.CPU:  # every layer a tensor of its own: one region each
        backings.append(closing(Backing.adopt(layout, padded_layer_tensors(layout, 4096, 0), alignment=4096)))
    for backing in backings:
        descriptors = backing.region_descriptors("decode-0", 1, transport, remote_writable=True)
        assert [descriptor.address for descriptor in descriptors] == [0] * len(backing.regions)
        validate_engine_info(backing.engine_info("decode-0", 1, Role.DECODE, "node-a", descriptors))


def test_verbs_regions_keep_their_address(closing: Callable[[Backing], Backing]) -> None:
    """RDMA writes name a remote virtual address: there it is part of the region."""
    backing = closing(Backing.allocate(llama_gqa(num_blocks=4, num_layers=2), MemoryKind.CPU))
    (descriptor,) = backing.region_descriptors("decode-0", 1, TransportKind.VERBS, remote_writable=True)
    assert descriptor.address == backing.regions[0].address != 0


def test_every_dtype_gets_a_view() -> None:
    layers = tuple(
        LayerSpec(name=f"l-{dtype}", geometry=Geometry(block_size=3, entry_shape=(5,), dtype=dtype))
        for dtype in sorted(DTYPE_ITEMSIZE)
    )
    layout = KVLayout(layers=layers, num_blocks=2)
    backing = Backing.allocate(layout)
    for spec in layout.layers:
        assert backing.view(spec.name).dtype == TORCH_DTYPES[spec.geometry.dtype]
        assert backing.view(spec.name).element_size() == spec.geometry.itemsize


@given(st.integers(0, 2**47), st.integers(0, 2**34))
def test_huge_page_advice_stays_inside_the_allocation(address: int, nbytes: int) -> None:
    from kvray.memory import huge_page_span

    span = huge_page_span(address, nbytes)
    huge = 2 * 1024 * 1024
    if span is None:
        # No whole 2 MiB page fits.
        first = align_up(address, huge)
        assert first + huge > address + nbytes
        return
    start, length = span
    assert start % huge == 0 and length % huge == 0 and length > 0
    assert address <= start and start + length <= address + nbytes


# ---- (h) one region per storage: layers an engine carves out of one pool ---------------------


def pooled_tensors(
    layout: KVLayout, pools: int, lead: int, gaps: list[int], tail: int, order: list[int]
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Layer tensors packed into `pools` storages (layers dealt round-robin in `order`), each
    pool `lead` bytes past a page boundary of its storage, layers `gaps[i]` bytes apart, `tail`
    bytes after the last; the storages are filled with the canary."""
    names = [layout.layer_names[i] for i in order]
    groups = [names[pool::pools] for pool in range(pools)]
    tensors: dict[str, torch.Tensor] = {}
    storages = []
    for group in groups:
        sizes = [layout.layer_nbytes(name) for name in group]
        used = sum(sizes) + sum(gaps[: len(group)])
        page = 4096
        storage = torch.full((used + lead + tail + 2 * page,), CANARY, dtype=torch.uint8)
        # The storage itself starts wherever torch put it; the pool starts at a page boundary + lead.
        base = (-storage.data_ptr()) % page
        pool = storage[base : base + lead + used + tail]
        storages.append(storage)
        offset = lead
        for name, size, gap in zip(group, sizes, gaps, strict=False):
            offset += gap
            dtype = TORCH_DTYPES[layout.layer(name).geometry.dtype]
            tensors[name] = pool[offset : offset + size].view(dtype).view(layout.tensor_shape(name))
            offset += size
    return tensors, storages


@settings(max_examples=150)
@given(
    alignment=st.sampled_from([4096, 8192, 16384]),
    pools=st.integers(1, 2),
    lead=st.integers(0, 40).map(lambda units: units * 512),
    gaps=st.lists(st.integers(0, 600).map(lambda units: units * 8), min_size=5, max_size=5),
    tail=st.integers(0, 40).map(lambda units: units * 512),
    order=st.permutations(range(5)),
)
@example(alignment=4096, pools=1, lead=4096, gaps=[0] * 5, tail=4096, order=[0, 1, 2, 3, 4])  # dense
def test_adopt_covers_layers_sharing_a_storage_with_one_region(
    alignment: int, pools: int, lead: int, gaps: list[int], tail: int, order: list[int]
) -> None:
    layout = small_layout(num_blocks=2)
    tensors, _storages = pooled_tensors(layout, pools, lead, gaps, tail, list(order))
    by_storage: dict[int, list[str]] = {}
    for name in layout.layer_names:
        by_storage.setdefault(tensors[name].untyped_storage().data_ptr(), []).append(name)
    try:
        backing = Backing.adopt(layout, tensors, alignment=alignment)
    except RegionError:
        # Only when some pool's aligned span really leaves its storage.
        fits = []
        for names in by_storage.values():
            storage = tensors[names[0]].untyped_storage()
            first = min(tensors[name].data_ptr() for name in names)
            last = max(tensors[name].data_ptr() + layout.layer_nbytes(name) for name in names)
            fits.append(
                first - first % alignment >= storage.data_ptr()
                and align_up(last, alignment) <= storage.data_ptr() + storage.nbytes()
            )
        assert not all(fits), "refused pools whose aligned span fits in their storage"
        return
    assert len(backing.regions) == len(by_storage)
    spans = []
    for region in backing.regions:
        storage = region.tensor.untyped_storage()
        assert region.address % alignment == 0 and region.nbytes % alignment == 0
        assert region.span.offset_in_allocation >= 0
        assert_region_inside(region.address, region.nbytes, storage.data_ptr(), storage.nbytes())
        spans.append((region.address, region.address + region.nbytes))
    spans.sort()
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start, "two regions overlap"
    for name in layout.layer_names:
        placement = backing.placements[name]
        region = backing.regions[placement.region]
        assert region.tensor.untyped_storage().data_ptr() == tensors[name].untyped_storage().data_ptr()
        assert placement.offset >= 0
        assert placement.offset + layout.layer_nbytes(name) <= region.nbytes
        first, last = view_byte_span(tensors[name])  # K and V halves alike
        assert region.address <= first and last <= region.address + region.nbytes
        assert region.address + placement.offset == tensors[name].data_ptr()
    # A peer accepts the engine (no "two layers at one address", no region overlap).
    for role in (Role.PREFILL, Role.DECODE):
        validate_engine_info(
            backing.engine_info(
                "pooled-0",
                1,
                role,
                "node-a",
                backing.region_descriptors(
                    "pooled-0", 1, TransportKind.RAY, remote_writable=role is Role.DECODE
                ),
            )
        )


def test_adopt_refuses_storages_that_alias_one_memory() -> None:
    """Two storages over the same bytes (e.g. two from_blob of one pointer) would give two
    overlapping regions; refused when adopted, not later by every peer."""
    layout = llama_gqa(num_blocks=2, num_layers=2)
    first, second = layout.layer_names
    nbytes = layout.layer_nbytes(first)
    array = np.full(2 * nbytes + 6 * 4096, CANARY, dtype=np.uint8)
    start = (-array.ctypes.data) % 4096 + 4096
    dtype = TORCH_DTYPES[layout.layer(first).geometry.dtype]
    whole = torch.from_numpy(array[start - 4096 : start + 2 * nbytes + 3 * 4096])
    alias = torch.from_numpy(array[start - 4096 : start + 2 * nbytes + 2 * 4096])  # same base, shorter
    assert whole.untyped_storage().data_ptr() == alias.untyped_storage().data_ptr()
    # Back to back, 64 bytes past a page: their aligned spans share the page between them.
    first_at, second_at = 4096 + 64, 4096 + 64 + nbytes
    tensors = {
        first: whole[first_at : first_at + nbytes].view(dtype).view(layout.tensor_shape(first)),
        second: alias[second_at : second_at + nbytes].view(dtype).view(layout.tensor_shape(second)),
    }
    with pytest.raises(RegionError, match="overlap"):
        Backing.adopt(layout, tensors, alignment=4096)


def test_adopt_defaults_to_the_settings_alignment() -> None:
    layout = small_layout(num_blocks=2)
    tensors = padded_layer_tensors(layout, 16384, 0)
    backing = Backing.adopt(layout, tensors, settings=Settings(alignment=16384))
    assert backing.alignment == 16384
    assert all(region.address % 16384 == 0 and region.nbytes % 16384 == 0 for region in backing.regions)
    assert Backing.adopt(layout, tensors).alignment == Settings().alignment


# ---- (i) one alignment check at every entry point ------------------------------------------

BAD_ALIGNMENTS = [0, 3000, 100, 6144, 4097, -4096, 2048, 64, True, 4096.0, "4096"]


@pytest.mark.parametrize("alignment", BAD_ALIGNMENTS, ids=repr)
def test_every_entry_point_refuses_a_bad_alignment(alignment: object) -> None:
    layout = small_layout(num_blocks=2)
    bad: Any = alignment
    with pytest.raises(ConfigError, match="alignment") as caught:
        place_region(0x10064, 300000, 262144, bad)
    assert caught.value.value == alignment
    with pytest.raises(ConfigError, match="alignment"):
        cover_region(0x10000, 0x40000, 0x10064, 0x1000, bad)
    with pytest.raises(ConfigError, match="alignment"):
        Backing.allocate(layout, alignment=bad)
    buffer = torch.empty(align_up(layout.nbytes, 4096) + 3 * 4096, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="alignment"):
        Backing.in_buffer(layout, buffer, alignment=bad)
    with pytest.raises(ConfigError, match="alignment"):
        Backing.adopt(layout, padded_layer_tensors(layout, 4096, 0), alignment=bad)


def test_place_region_never_answers_a_negative_offset() -> None:
    """The seed bug's exact shape: a negative alignment placed the region 100 bytes before the
    allocation."""
    with pytest.raises(ConfigError):
        place_region(0x10064, 300000, 262144, -4096)


@pytest.mark.parametrize("alignment", [4096, 8192, 1 << 21])
def test_page_multiples_of_two_are_accepted(alignment: int) -> None:
    span = place_region(0x10064, align_up(262144, alignment) + alignment, 262144, alignment)
    assert span.offset_in_allocation >= 0 and span.start % alignment == 0
