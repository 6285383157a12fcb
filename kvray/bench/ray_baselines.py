"""What a Ray user without kvray writes to move the same blocks: Ray's object store and Ray
Direct Transport (RDT) over gloo.

- `Ray object store (numpy gather/scatter)`: the sender actor gathers the request's blocks
  with numpy fancy indexing into one new array (`np.take` per segment), passes it to the
  receiver actor as a call argument (Ray copies it into its shared-memory object store; the
  receiver maps it without a copy), and the receiver scatters it into its destination blocks.
- `Ray object store, payload only`: the same call with one pre-gathered contiguous array and
  no scatter: the object store's own cost, as a reference (nothing lands in any block; the
  received payload itself is what is verified).
- `Ray Direct Transport, gloo`: an actor method declared with
  `@ray.method(tensor_transport="gloo")` returns the gathered tensor; Ray sends it to the
  receiver over a `torch_gloo` collective group instead of the object store; the receiver
  scatters it.

Runs are timed from the sender's first step (a clock stamp before the gather) to the end of the
receiver's scatter (a clock stamp in the receiver): `time.perf_counter` is one clock for every
process of the machine.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import ray
import torch

from kvray.bench.harness import Contender, Run
from kvray.bench.verify import (
    Verdict,
    compare_payload,
    expected_payload,
    failed,
    fill_source,
    scrub,
    verify_destination,
)
from kvray.bench.workload import ByteArray, Workload, gather, scatter

OBJECT_STORE = "Ray object store (numpy gather/scatter)"
OBJECT_STORE_PAYLOAD = "Ray object store, payload only (reference)"
RDT_GLOO = "Ray Direct Transport, gloo (gather/scatter)"
TIMED = "sender's first step -> receiver's scatter done (two actors)"


class Receiver:
    """Destination blocks of one case; receives a gathered payload and scatters it."""

    def setup(self, workload: Workload) -> None:
        torch.set_num_threads(1)
        self.workload = workload
        self.pool = np.zeros(workload.region_nbytes, dtype=np.uint8)
        self.dst_ids = workload.dst_ids()  # made before any clock starts, as kvray's are
        self.payload_verdict: Verdict | None = None

    def scrub(self, run: int) -> None:
        scrub(self.pool, run)
        self.payload_verdict = None

    def receive(self, payload: ByteArray | torch.Tensor) -> float:
        if isinstance(payload, torch.Tensor):
            payload = payload.numpy()
        scatter(self.pool, self.workload, self.dst_ids, payload)
        return time.perf_counter()

    def receive_payload(self, payload: ByteArray) -> float:
        received = time.perf_counter()
        self.payload_verdict = compare_payload(payload, self.workload)  # after the clock stamp
        return received

    def verify(self, payload_only: bool) -> Verdict:
        if payload_only:
            return self.payload_verdict or failed("no payload arrived")
        return verify_destination(self.pool, self.workload)

    def teardown(self) -> None:
        del self.pool


class Source:
    """Source blocks of one case, filled with the verification pattern."""

    def setup(self, workload: Workload, payload: bool) -> None:
        torch.set_num_threads(1)
        self.workload = workload
        self.pool = np.zeros(workload.region_nbytes, dtype=np.uint8)
        fill_source(self.pool, workload)
        self.src_ids = workload.src_ids()  # made before any clock starts, as kvray's are
        self.payload = expected_payload(workload) if payload else None
        self.started = 0.0

    def gathered(self) -> torch.Tensor:
        """The RDT sender's method body (see `GlooSender.send`): stamp the clock, gather."""
        self.started = time.perf_counter()
        return torch.from_numpy(gather(self.pool, self.workload, self.src_ids))

    def start_time(self) -> float:
        return self.started

    def teardown(self) -> None:
        del self.pool, self.payload


class Sender(Source):
    """The object-store sender (an async actor: it awaits the receiver's call)."""

    async def push(self, receiver: Any) -> tuple[float, float]:
        """Gather, hand the array to the receiver through the object store, wait for its scatter."""
        started = time.perf_counter()
        payload = gather(self.pool, self.workload, self.src_ids)
        scattered = await receiver.receive.remote(payload)
        return started, scattered

    async def push_payload(self, receiver: Any) -> tuple[float, float]:
        started = time.perf_counter()
        received = await receiver.receive_payload.remote(self.payload)
        return started, received


class GlooSender(Source):
    @ray.method(tensor_transport="gloo")
    def send(self) -> torch.Tensor:
        return self.gathered()


SenderActor = ray.remote(Sender)
ReceiverActor = ray.remote(Receiver)
# Ray's typed overloads of `ray.remote` do not list this option yet.
_tensor_transport_actor: Any = ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
GlooSenderActor = _tensor_transport_actor(GlooSender)
GlooReceiverActor = _tensor_transport_actor(Receiver)


class ObjectStore(Contender):
    family = "ray-object-store"
    names = (OBJECT_STORE, OBJECT_STORE_PAYLOAD)
    timed: ClassVar[Mapping[str, str]] = {
        OBJECT_STORE: TIMED,
        OBJECT_STORE_PAYLOAD: "sender's first step -> receiver holds the payload (two actors)",
    }

    def start(self) -> str | None:
        self.sender: Any = SenderActor.remote()
        self.receiver: Any = ReceiverActor.remote()
        self.actors = (self.sender, self.receiver)
        return None

    def setup(self, workload: Workload) -> None:
        ray.get([self.sender.setup.remote(workload, True), self.receiver.setup.remote(workload)])

    def run(self, name: str, run: int) -> Run:
        payload_only = name == OBJECT_STORE_PAYLOAD
        ray.get(self.receiver.scrub.remote(run))
        if payload_only:
            started, done = ray.get(self.sender.push_payload.remote(self.receiver))
        else:
            started, done = ray.get(self.sender.push.remote(self.receiver))
        return Run(done - started, ray.get(self.receiver.verify.remote(payload_only)))


class RdtGloo(Contender):
    family = "rdt-gloo"
    names = (RDT_GLOO,)
    timed: ClassVar[Mapping[str, str]] = {RDT_GLOO: TIMED + "; the driver chains the two calls"}

    def start(self) -> str | None:
        try:
            import torch.distributed as dist
            from ray.experimental.collective import create_collective_group
        except ImportError as error:
            return f"Ray Direct Transport is not in this Ray build: {error}"
        if not dist.is_available() or not dist.is_gloo_available():
            return "this torch build has no gloo backend"
        self.sender: Any = GlooSenderActor.remote()
        self.receiver: Any = GlooReceiverActor.remote()
        self.actors = (self.sender, self.receiver)
        create_collective_group([self.sender, self.receiver], backend="torch_gloo")
        return None

    def setup(self, workload: Workload) -> None:
        ray.get([self.sender.setup.remote(workload, False), self.receiver.setup.remote(workload)])

    def run(self, name: str, run: int) -> Run:
        ray.get(self.receiver.scrub.remote(run))
        tensor = self.sender.send.remote()
        done = ray.get(self.receiver.receive.remote(tensor))
        started = ray.get(self.sender.start_time.remote())
        del tensor
        return Run(done - started, ray.get(self.receiver.verify.remote(False)))
