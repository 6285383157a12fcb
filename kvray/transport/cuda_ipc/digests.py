"""Where a hashing copy's digests go on their way to the host: the programs add their content
(`kvray.content`) and placement (`kvray.placement`) sums into a cell's slots on the GPU, the
fold kernel adds those up into two pinned host int64 (and zeroes the slots), and the writer
reads them once the copy's event has completed.
"""

from __future__ import annotations

import numpy as np
import torch

from kvray.placement import MASK64, Stored
from kvray.transport.cuda_ipc.kernels import SLOTS, fold_kernel


class DigestCell:
    """One hashing write's slots (2 x `SLOTS` int64 on the GPU: content, then placement; zero
    between writes) and the two pinned host int64 its fold writes the totals into."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slots = torch.zeros(2 * SLOTS, dtype=torch.int64, device=device)
        self.host = torch.zeros(2, dtype=torch.int64, pin_memory=True)
        self._view = self.host.numpy().view(np.uint64)

    def fold(self) -> None:
        """Queue the fold on the current stream: after the copies that add into the slots."""
        fold_kernel()[(1,)](self.slots, self.host, SLOTS=SLOTS, num_warps=4)

    def value(self, *, content: bool = True) -> Stored:
        """The digests (the content's only where the copy hashed it); read them only once the
        fold's stream has passed it."""
        return Stored(int(self._view[1]) & MASK64, int(self._view[0]) & MASK64 if content else None)


_free: dict[int, list[DigestCell]] = {}


def take_cell(device: torch.device) -> DigestCell:
    """A free cell of `device` (made when none is free: pinning host memory costs far more than
    a copy's launch, so cells are reused)."""
    free = _free.setdefault(device.index or 0, [])
    return free.pop() if free else DigestCell(device)


def give_back(cell: DigestCell) -> None:
    """Return a cell whose fold has completed (its slots are zero again). A cell whose copy
    failed is not given back: its slots may hold a partial sum."""
    _free.setdefault(cell.device.index or 0, []).append(cell)
