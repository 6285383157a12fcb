"""What a prefill engine's native lane (`kvray.agent.lane`) copies into one decode engine with,
on GPUs: the opened target region, the pair's row table and row copies captured for it (as
`graphs` captures them: fetch the ids from pinned staging, the row kernel reporting both
digests, the fold), several of each size so that the lane launches an ask's copy while earlier
ones still run, and the stream and context they run in. The lane's C threads fill the staging,
launch and wait through the driver (`driver.lane_calls`); this keeps the memory they use alive
until the pair is let go.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvray.transport.cuda_ipc.driver import primary_context
from kvray.transport.cuda_ipc.graphs import RowGraph, RowTable, capacity_for, capture_rows
from kvray.transport.cuda_ipc.kernels import Digests

#: Captured copies of each size: an ask's copy is launched while up to this many run.
PER_SIZE = 3
#: The smallest size captured (`graphs.capacity_for`'s).
SMALLEST = capacity_for(1)


@dataclass
class LaneCopies:
    """One pair's captured copies, and what they write into and run in."""

    target: torch.Tensor
    source: torch.Tensor
    table: RowTable
    #: The driver's context of the target's GPU, where the copies are launched and waited for.
    context: int
    stream: torch.cuda.Stream
    #: What keeps `target` open (the transport's opened handle), until the pair is let go.
    keep: object
    graphs: list[RowGraph] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        """The most block pairs one copy takes (0: none captured)."""
        return max((int(graph.staging.size - 1) // 2 for graph in self.graphs), default=0)

    def grow(self, blocks: int) -> bool:
        """Capture copies of every size up to the one a request of `blocks` block pairs uses
        (and the next, for a request a little larger), `PER_SIZE` of each; False: none new."""
        sizes = []
        size = SMALLEST
        wanted = 2 * capacity_for(blocks)
        have = self.capacity
        while size <= wanted:
            if size > have:
                sizes.append(size)
            size *= 2
        if not sizes:
            return False
        with torch.cuda.device(self.target.device):
            for size in sizes:
                for _ in range(PER_SIZE):
                    self.graphs.append(
                        capture_rows(self.target, self.source, self.table, size, Digests.CONTENT)
                    )
        return True

    def records(self) -> list[tuple[int, int, int, int, int, int]]:
        """Each copy as the lane takes it: size, graph, staging, produced and done events,
        digest cell (content then placement, pinned host int64)."""
        out = []
        for graph in self.graphs:
            assert graph.cell is not None
            out.append(
                (
                    int(graph.staging.size - 1) // 2,
                    graph.exec_handle,
                    int(graph.pinned.data_ptr()),
                    graph.produced_handle,
                    int(graph.done.cuda_event),
                    int(graph.cell.host.data_ptr()),
                )
            )
        return out


def lane_copies(target: torch.Tensor, source: torch.Tensor, table: RowTable, keep: object) -> LaneCopies:
    """A pair's copies, none captured yet (`LaneCopies.grow`), on a stream of their own."""
    device = target.device
    context = primary_context(device)  # the context torch captures the copies in
    stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    return LaneCopies(target, source, table, context, stream, keep)
