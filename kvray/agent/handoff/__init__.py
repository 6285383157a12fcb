"""The P/D hand-off between two engines' agents, the same for every engine integration: a decode
engine asks a prefill engine to push a request the prefill engine holds (push requests are the
decode-to-prefill half of kvray's push; the KV and the completion notice are the other).

    specs     what an engine's scheduler decides, as plain values: `BlockTable`, `LoadSpec`,
              `SendSpec`, `LayerwiseSpec`, one step's decisions (`HandoffStep`), where a
              prefill engine takes push requests (`PrefillAddress`); pure
    events    what the engine hears (`HandoffReports`) and an observer sees (`HandoffEvent`,
              `Moved`, `HandoffObserver`); the deployment's proof of an ask (`AskProof`)
    side      what both sides share: what they are built over (`Wiring`: the agent, the
              reports, the observer, the proof) and the tasks they run
    prefill   `PrefillSide`: holds, parked push requests, pushes whole or layer by layer; its
              part of each step (sends, dropped, released)
    decode    `DecodeSide`: loads, their push requests and withdrawals, the wait that watches
              the prefill engine; its part of each step (loads, withdrawn, cancelled)
    facade    `Handoff`: both sides over one agent, behind the calls an engine integration makes

Who does what:

    decode   `load`: reserve the blocks the engine allocated (`KVAgent.expect`), send the
             prefill engine a `PushRequest` (fenced by both incarnations, carrying the
             reservation's token), wait for the KV (failing early once the prefill engine is
             seen gone: `DecodeSide.gone`), release, report (`HandoffReports.loaded`).
             `cancel`: the engine ended the request meanwhile: the wait ends, the prefill engine
             is told (`PushWithdrawn`). `withdraw`: a load that never began, told the same way.
    prefill  `hold`: a finished request's blocks, under its hand-off id, until a push request
             takes them (one push, then `HandoffReports.sent`: the blocks may go) or `lease_s`
             passes. `take`: a push request or a withdrawal. A push request that comes before
             its request is held is parked for a lease (at most `max_expected_requests` of
             them); one that cannot be answered is refused at once (the decode side's wait
             fails). `layerwise` and `save_layer`: a request whose forward runs while its decode
             engine waits has each layer pushed as the forward saves it, once asked (the
             layer's push is handed what says its KV is written: `kvray.memory.SourceReady`);
             `preempt`: its layer copies end and the ask is parked again, to push the request
             whole when it finishes. `drop` and `release`: the request will have no KV, or its
             decode leg failed.

How push requests and withdrawals travel: like completion notices, through the first notice
channel that reaches the prefill engine (`KVAgent.push_requests`, a `kvray.notice.NoticeSet` of
the `PUSH_REQUESTS` mailbox): its datagram inbox on this node (named by its ticket, no lookup),
else, for engines that joined Ray, its TCP listener or a `PeerCall.REQUEST_PUSH` call on its
host, as the coordinator lists them. The prefill side serves them (`KVAgent.serve_push_requests`),
and the agent opens and publishes those mailboxes as it starts. Each push request travels alone,
so a prefill engine starts pushing the first of a step's requests while the decode engine still
reserves the next. Releases come from the engine's scheduler (`HandoffStep.released`), not from a peer.

Routine hand-offs on one node may skip both event loops through the prefill engine's native
lane (`kvray.agent.lane`, `Settings.native_lane`): the decode engine asks from its own thread, a C
thread of the prefill engine pushes; the prefill side here offers it each hold once its digests
are taken, settles the asks waiting in it for a hand-off it will not offer, and takes a hold back
from it before anything else ends or pushes the request. An observer sees lane pushes on both
sides as it sees the others.

A hand-off id whose request is gone (pushed, dropped, released, withdrawn, or its lease ended)
is spent for a lease: push requests and holds under it are refused at once, so a second request
under one id never replaces the first. An engine integration builds a `Handoff` over its agent
before the agent starts, hands over its scheduler's decisions (`Handoff.step`), calls `expire`
now and then, hears back through `HandoffReports`, and may install a `HandoffObserver`
(`kvray.bench.handoff_log`). Everything here runs on the agent's event loop.
"""

from kvray.agent.handoff.events import AskProof, HandoffEvent, HandoffObserver, HandoffReports, Moved
from kvray.agent.handoff.facade import Handoff
from kvray.agent.handoff.specs import (
    NO_BLOCK,
    BlockTable,
    HandoffStep,
    LayerwiseSpec,
    LoadSpec,
    PrefillAddress,
    SendSpec,
    one_group,
    rank_engine_id,
    table_blocks,
)
from kvray.notice.local import PUSH_ENDPOINT

__all__ = [
    "NO_BLOCK",
    "PUSH_ENDPOINT",
    "AskProof",
    "BlockTable",
    "Handoff",
    "HandoffEvent",
    "HandoffObserver",
    "HandoffReports",
    "HandoffStep",
    "LayerwiseSpec",
    "LoadSpec",
    "Moved",
    "PrefillAddress",
    "SendSpec",
    "one_group",
    "rank_engine_id",
    "table_blocks",
]
