"""One engine's hand-offs (`Handoff`): the prefill side and the decode side over the engine's
agent, composed behind the calls an engine integration makes. See `kvray.agent.handoff`."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from kvray.agent.handoff.decode import DecodeSide
from kvray.agent.handoff.events import AskProof, HandoffObserver, HandoffReports
from kvray.agent.handoff.prefill import PrefillSide
from kvray.agent.handoff.side import Wiring
from kvray.agent.handoff.specs import HandoffStep, LayerwiseSpec, LoadSpec, SendSpec
from kvray.agent.kvagent import KVAgent
from kvray.memory import SourceReady


class Handoff:
    """Both sides of one engine's hand-offs over its agent (see `kvray.agent.handoff`); the
    two share nothing but the agent. Build it before the agent starts: the prefill side serves
    the agent's push requests (`KVAgent.serve_push_requests`), whose mailboxes the agent opens
    and publishes as it starts. `joined`: the engine joined Ray, so the coordinator knows its
    peers and their host actors. `proof`: the deployment's key; with it, every push request
    and withdrawal this engine sends carries a proof, and one that comes without a valid proof
    is dropped unread."""

    def __init__(
        self,
        agent: KVAgent,
        reports: HandoffReports,
        *,
        lease_s: float,
        joined: bool = False,
        observer: HandoffObserver | None = None,
        proof: AskProof | None = None,
    ) -> None:
        self.agent = agent
        wiring = Wiring(agent, reports, joined, observer, proof)
        self.prefill = PrefillSide(wiring, lease_s=lease_s)
        self.decode = DecodeSide(wiring)

    def parked(self) -> int:
        """How many push requests wait for their request here."""
        return self.prefill.parked()

    def close(self) -> None:
        """Cancel what is under way (before the agent closes, which ends every wait)."""
        self.prefill.close()
        self.decode.close()

    # ---- the scheduler's decisions --------------------------------------------------------

    def step(self, step: HandoffStep) -> None:
        """One step's hand-offs: sends to hold, hand-offs that will never have KV (`dropped`),
        held requests whose decode leg failed (`released`), loads to start, loads no longer
        wanted (`cancelled`) and loads that ended before they began (`withdrawn`)."""
        self.prefill.step(step)
        self.decode.step(step)

    # ---- prefill side ---------------------------------------------------------------------

    def hold(self, spec: SendSpec) -> None:
        self.prefill.hold(spec)

    def drop(self, key: str) -> None:
        self.prefill.drop(key)

    def release(self, key: str) -> None:
        self.prefill.release(key)

    def expire(self) -> None:
        self.prefill.expire()

    def take(self, message: bytes) -> None:
        self.prefill.take(message)

    def layerwise(self, specs: Mapping[str, LayerwiseSpec]) -> None:
        self.prefill.layerwise(specs)

    def save_layer(self, layer_name: str, ready: SourceReady = None) -> None:
        self.prefill.save_layer(layer_name, ready)

    async def preempt(self, keys: Collection[str], wait_s: float) -> None:
        await self.prefill.preempt(keys, wait_s)

    # ---- decode side ----------------------------------------------------------------------

    def load(self, spec: LoadSpec) -> None:
        self.decode.load(spec)

    def cancel(self, request_id: str) -> None:
        self.decode.cancel(request_id)

    def lane_loaded(self, spec: LoadSpec, seconds: float) -> None:
        self.decode.lane_loaded(spec, seconds)

    async def withdraw(self, spec: LoadSpec) -> None:
        await self.decode.withdraw(spec)
