"""The digest log's hashes (`kvray.bench.handoff_log.DigestLog`), which the vLLM tests compare
across engines: per layer, a request's blocks and nothing else; per KV head, the same head's
bytes whatever the engine's tensor-parallel size. One byte changed changes exactly the digests
that hold it."""

from __future__ import annotations

import numpy as np
import torch
from head_layouts import head_layout

from kvray.bench.handoff_log import DigestLog
from kvray.layout import TensorParallel
from kvray.memory import Backing

HEADS, TOKENS, CONTENT, LAYERS, BLOCKS = 4, 4, 6, 3, 8


def backing(tp: TensorParallel) -> Backing:
    """vLLM's CPU order per rank: heads, tokens, K and V; every value names its global head,
    token, content index, layer and block."""
    heads = tp.local_heads
    layout = head_layout(tp, tokens=TOKENS, content=CONTENT, layers=LAYERS, num_blocks=BLOCKS)
    made = Backing.allocate(layout)
    head = np.arange(tp.first_head, tp.first_head + heads, dtype=np.float32).reshape(1, -1, 1, 1)
    token = np.arange(TOKENS, dtype=np.float32).reshape(1, 1, -1, 1)
    content = np.arange(CONTENT, dtype=np.float32).reshape(1, 1, 1, -1)
    block = np.arange(BLOCKS, dtype=np.float32).reshape(-1, 1, 1, 1)
    for index, view in enumerate(made.views.values()):
        values = index * 1e5 + block * 1e3 + head * 100 + token * 10 + content
        view.copy_(torch.from_numpy(values.reshape(view.shape)))
    return made


def test_head_digests_agree_across_tensor_parallel_sizes_and_catch_one_byte() -> None:
    log = DigestLog("/dev/null")
    whole = backing(TensorParallel(size=1, rank=0, kv_heads=HEADS))
    halves = [backing(TensorParallel(size=2, rank=rank, kv_heads=HEADS)) for rank in range(2)]
    groups = ((5, 2),)
    heads = log.head_digests(whole, "h", groups)
    split = {**log.head_digests(halves[0], "h", groups), **log.head_digests(halves[1], "h", groups)}
    assert sorted(heads) == sorted(f"layer{i}#{h}" for i in range(LAYERS) for h in range(HEADS))
    assert heads == split
    layers = log.digests(whole, "h", groups)
    assert sorted(layers) == [f"layer{i}" for i in range(LAYERS)]

    # A block outside the request changes nothing; one byte of head 3 in layer 1, block 2, only
    # that head's and that layer's digests.
    list(whole.views.values())[1][7].view(torch.uint8)[0] ^= 0xFF
    assert log.head_digests(whole, "h", groups) == heads and log.digests(whole, "h", groups) == layers
    view = list(whole.views.values())[1]
    view[2].view(HEADS, TOKENS, CONTENT)[3, 1, 0] += 1.0
    changed = log.head_digests(whole, "h", groups)
    assert {key for key in heads if changed[key] != heads[key]} == {"layer1#3"}
    assert {key for key, value in log.digests(whole, "h", groups).items() if value != layers[key]} == {
        "layer1"
    }
    # The last value of a block (head 3's, in layer 0) counts as well as any other.
    whole.view("layer0")[5].view(HEADS, TOKENS, CONTENT)[3, TOKENS - 1, CONTENT - 1] += 1.0
    again = log.head_digests(whole, "h", groups)
    assert {key for key in heads if again[key] != heads[key]} == {"layer0#3", "layer1#3"}
    assert {key for key, value in log.digests(whole, "h", groups).items() if value != layers[key]} == {
        "layer0",
        "layer1",
    }


def test_one_request_in_every_is_hashed_alike_on_both_sides() -> None:
    made = backing(TensorParallel(size=1, rank=0, kv_heads=HEADS))
    log = DigestLog("/dev/null", every=3)
    hashed = [key for key in (f"k{i}" for i in range(30)) if log.digests(made, key, ((1,),))]
    assert 0 < len(hashed) < 30
    assert all(
        bool(log.head_digests(made, key, ((1,),))) == (key in hashed) for key in (f"k{i}" for i in range(30))
    )
