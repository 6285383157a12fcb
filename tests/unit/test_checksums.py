"""The two checksum algorithms of `kvray.integrity` as pure functions: `wsum64` gives the same
value from torch (the GPU path, run here on the CPU), from numpy over a stream cut anywhere,
and from the closed form; one flipped bit anywhere, a block moved and a byte cut off each change
it. Both memories (`HostRegions`, `DeviceRegions`) compute either algorithm to the same value, so
a writer on a GPU and a decode engine in host memory (or the reverse) agree."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from kvray.integrity import (
    WSUM64,
    WSUM64_K,
    XXH3_64,
    DeviceRegions,
    HostRegions,
    Pieces,
    WeightedSum,
    wsum64,
)

MASK = (1 << 64) - 1


def closed_form(data: bytes) -> int:
    """The definition, word by word in Python integers."""
    padded = data + bytes(-len(data) % 4)
    words = [int.from_bytes(padded[i : i + 4], "little") for i in range(0, len(padded), 4)]
    total = sum(words)
    weighted = sum((i + 1) * word for i, word in enumerate(words))
    return (weighted + WSUM64_K * total + len(data)) & MASK


def streamed(data: bytes, cuts: list[int]) -> int:
    summer = WeightedSum()
    edges = [0, *sorted(cuts), len(data)]
    for start, end in itertools.pairwise(edges):
        summer.update(np.frombuffer(data[start:end], dtype=np.uint8))
    return summer.value()


@pytest.mark.parametrize("length", [0, 1, 3, 4, 7, 4096, 4099, 65537])
def test_torch_numpy_and_the_definition_agree(length: int) -> None:
    rng = random.Random(length)
    data = bytes(rng.getrandbits(8) for _ in range(length))
    expected = closed_form(data)
    assert (
        wsum64(
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        )
        == expected
    )
    cuts = [rng.randrange(length + 1) for _ in range(5)]
    assert streamed(data, cuts) == expected
    # Words near 2**32 - 1 and a long stream: the sums wrap mod 2**64 alike everywhere.
    high = bytes([0xFF]) * length
    assert wsum64(torch.full((length,), 0xFF, dtype=torch.uint8)) == closed_form(high) == streamed(high, cuts)


def test_an_unaligned_tensor_and_chunking_give_the_same_value(monkeypatch: pytest.MonkeyPatch) -> None:
    data = torch.randint(0, 256, (40_001,), dtype=torch.uint8)
    whole = wsum64(data)
    assert wsum64(data[1:]) == closed_form(bytes(data[1:].numpy()))
    import kvray.integrity as integrity

    monkeypatch.setattr(integrity, "_WSUM_CHUNK_WORDS", 7)
    assert wsum64(data) == whole == streamed(bytes(data.numpy()), [5, 9, 20_000])


def test_one_flipped_bit_anywhere_changes_it() -> None:
    rng = random.Random(7)
    data = bytearray(rng.getrandbits(8) for _ in range(16_384))
    value = closed_form(bytes(data))
    for _ in range(300):
        at, bit = rng.randrange(len(data)), rng.randrange(8)
        data[at] ^= 1 << bit
        assert wsum64(torch.frombuffer(data, dtype=torch.uint8)) != value, (at, bit)
        data[at] ^= 1 << bit
    assert wsum64(torch.frombuffer(data, dtype=torch.uint8)) == value


def test_moved_blocks_and_a_short_stream_change_it() -> None:
    rng = random.Random(11)
    blocks = [bytes(rng.getrandbits(8) for _ in range(512)) for _ in range(8)]
    value = closed_form(b"".join(blocks))
    swapped = [blocks[1], blocks[0], *blocks[2:]]
    assert closed_form(b"".join(swapped)) != value
    assert closed_form(b"".join(blocks[:-1])) != value
    # One block written twice (the seed bug's shape: a layer over another).
    assert closed_form(b"".join([blocks[0], blocks[0], *blocks[2:]])) != value


def test_host_and_device_regions_compute_either_algorithm_alike() -> None:
    region = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    pieces = Pieces(
        region=np.zeros(5, dtype=np.int64),
        offset=np.array([4096, 0, 8192, 8192 + 300, 30_001], dtype=np.int64),
        nbytes=np.array([2048, 1024, 300, 700, 999], dtype=np.int64),
    )
    host, device = HostRegions([region.numpy()]), DeviceRegions([region])
    assert (host.algorithm, device.algorithm) == (XXH3_64, WSUM64)
    stream = b"".join(
        bytes(region.numpy()[start : start + length])
        for start, length in zip(pieces.offset.tolist(), pieces.nbytes.tolist(), strict=True)
    )
    assert host.digest(pieces, WSUM64) == device.digest(pieces, WSUM64) == closed_form(stream)
    import xxhash

    assert host.digest(pieces, XXH3_64) == device.digest(pieces, XXH3_64) == xxhash.xxh3_64_intdigest(stream)


def test_the_default_checks_about_one_request_in_a_hundred_and_all_ranks_alike() -> None:
    from kvray.config import Settings
    from kvray.integrity import sampled

    rate = Settings().integrity_sample_rate
    assert rate == 0.01
    ids = [f"req-{i}-{random.Random(i).getrandbits(64):x}" for i in range(20_000)]
    checked = sum(sampled(request_id, rate) for request_id in ids)
    assert 0.007 * len(ids) < checked < 0.013 * len(ids), checked
    # Decided by the id alone: asked again (another layer, another rank), the same answer.
    assert [sampled(i, rate) for i in ids[:500]] == [sampled(i, rate) for i in ids[:500]]
    assert all(sampled(i, 1.0) for i in ids[:100]) and not any(sampled(i, 0.0) for i in ids[:100])


def test_many_layers_at_once_equal_each_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """`DeviceRegions` sums every layer of a transfer with the same few kernels: each layer's
    value equals its own stream's, empty and unaligned layers and chunks that cut across
    layers included."""
    import kvray.integrity as integrity
    from kvray.integrity import wsum64_layers

    rng = random.Random(3)
    layers = [bytes(rng.getrandbits(8) for _ in range(n)) for n in (4096, 0, 13, 1, 8192, 6)]
    expected = tuple(closed_form(layer) for layer in layers)
    tensors = [
        torch.frombuffer(bytearray(layer), dtype=torch.uint8) if layer else torch.empty(0, dtype=torch.uint8)
        for layer in layers
    ]
    assert wsum64_layers(tensors) == expected
    monkeypatch.setattr(integrity, "_WSUM_CHUNK_WORDS", 5)
    assert wsum64_layers(tensors) == expected
    region = torch.randint(0, 256, (1 << 14,), dtype=torch.uint8)
    pieces = [
        Pieces(
            np.zeros(2, dtype=np.int64),
            np.array([100, 5000], dtype=np.int64),
            np.array([64, 300], dtype=np.int64),
        ),
        Pieces(np.zeros(1, dtype=np.int64), np.array([7], dtype=np.int64), np.array([1001], dtype=np.int64)),
    ]
    host, device = HostRegions([region.numpy()]), DeviceRegions([region])
    assert device.digest_layers(pieces, WSUM64) == host.digest_layers(pieces, WSUM64)
    assert device.digest_layers(pieces, XXH3_64) == host.digest_layers(pieces, XXH3_64)
