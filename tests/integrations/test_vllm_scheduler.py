"""`KvrayConnector`'s scheduler side against the kv_transfer_params a client can send: nothing
raises inside vLLM's scheduler (an exception there ends the engine core), a forged or malformed
load fails that request's load at once, an unsigned hold is not held, hand-off ids are minted
here, and what a prefill engine answers carries only what the decode side needs. No engine is
started (vLLM's request statuses are imported)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm_installed import require_vllm

require_vllm()

from vllm.v1.request import RequestStatus  # noqa: E402 - after the check that vLLM is installed

from kvray.agent.handoff import NO_BLOCK  # noqa: E402 - after the check that vLLM is installed
from kvray.errors import ConfigError  # noqa: E402 - after the check that vLLM is installed
from kvray.integrations.vllm import tickets  # noqa: E402 - after the check that vLLM is installed
from kvray.integrations.vllm.cache_layout import block_size_of  # noqa: E402 - after the check
from kvray.integrations.vllm.connector import KvrayConnector  # noqa: E402 - after the check
from kvray.integrations.vllm.metadata import KvrayHandshake  # noqa: E402 - after the check
from kvray.integrations.vllm.scheduler import ConnectorScheduler  # noqa: E402 - after the check

KEY = tickets.HandoffKey.from_hex(tickets.new_key_hex())
BLOCK_SIZE = 16
#: What a prefill engine's answer holds: the decode leg's flags and a signed `held` ticket.
HELD_FIELDS = frozenset(
    {
        "do_remote_prefill",
        "do_remote_decode",
        tickets.PREFILL_ENGINE,
        tickets.PREFILL_INCARNATION,
        tickets.PREFILL_REQUEST,
        tickets.PREFILL_NODE,
        tickets.PREFILL_INBOX,
        tickets.EXPIRES,
        tickets.TAG,
        tickets.RELEASE_TAG,
    }
)

#: A scheduler step that schedules no new request.
NOTHING_NEW = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={})


class Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def request(request_id: str, params: Any, tokens: int = 40) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=request_id,
        kv_transfer_params=params,
        prompt_token_ids=list(range(tokens)),
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
    )


def scheduler() -> ConnectorScheduler:
    sched = ConnectorScheduler("vllm-p", BLOCK_SIZE, KEY)
    sched.handshake = KvrayHandshake("vllm-p", 5, "node-1", "/dev/shm/kvray-inbox")
    return sched


def run_decode(sched: ConnectorScheduler, req: SimpleNamespace) -> Any:
    """vLLM's scheduler calls for a decode request: match, allocate, build the step's metadata."""
    count, asynchronous = sched.matched(req, 0)
    if count:
        sched.allocated(req, Blocks([3, 4, 5]), count)
    return count, asynchronous, sched.step(NOTHING_NEW)


def test_a_prefill_engine_mints_the_hand_off_id_and_answers_only_what_the_decode_side_needs() -> None:
    sched = scheduler()
    # One client request_id twice (vLLM adds its own suffix to each).
    first = request("cmpl-dup-1-a1b2c3d4", {"do_remote_decode": True})
    second = request("cmpl-dup-1-e5f6a7b8", {"do_remote_decode": True})
    answers = []
    for req in (first, second):
        sched.allocated(req, Blocks([1, 2]), 0)
        held, params = sched.finished(req, ([1, 2],))
        assert held
        answers.append(params)
    ids = [tickets.read_held(KEY, params).handoff_id for params in answers]
    assert ids[0] != ids[1] and "dup" not in ids[0]
    assert set(answers[0]) == HELD_FIELDS
    meta = sched.step(NOTHING_NEW)
    assert {spec.key for spec in meta.step.sends.values()} == set(ids)


def test_a_decode_engine_loads_by_a_signed_ticket() -> None:
    prefill = scheduler()
    held_req = request("p-1", {"do_remote_decode": True})
    prefill.allocated(held_req, Blocks([1, 2, 3]), 0)
    _, params = prefill.finished(held_req, ([1, 2, 3],))
    decode = ConnectorScheduler("vllm-d", BLOCK_SIZE, KEY)
    count, asynchronous, meta = run_decode(decode, request("d-1", dict(params)))
    assert (count, asynchronous) == (40, True)
    spec = meta.step.loads["d-1"]
    assert not spec.refusal
    assert (spec.prefill_engine, spec.prefill_incarnation, spec.prefill_inbox) == (
        "vllm-p",
        5,
        "/dev/shm/kvray-inbox",
    )
    assert spec.block_ids == ((3, 4, 5),)


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_prefill": True, tickets.PREFILL_ENGINE: "vllm-p", tickets.PREFILL_INCARNATION: "x"},
        {"do_remote_prefill": True, tickets.PREFILL_ENGINE: "vllm-p", tickets.HANDOFF: "a" * 32},
        {"do_remote_prefill": True, tickets.PREFILL_ENGINE: ["vllm-p"], tickets.HANDOFF: 5},
        {"do_remote_prefill": True, tickets.PREFILL_REQUEST: None, "kvray_prefill_info": "!!not base64"},
        {"do_remote_prefill": True, tickets.PREFILL_ENGINE: "vllm-p", tickets.PREFILL_INCARNATION: 2**80},
    ],
)
def test_a_forged_or_malformed_load_fails_that_load_and_raises_nothing(params: dict[str, Any]) -> None:
    count, asynchronous, meta = run_decode(scheduler(), request("d-1", params))
    assert (count, asynchronous) == (40, True)
    assert meta.step.loads["d-1"].refusal and meta.step.loads["d-1"].block_ids == ((3, 4, 5),)


def test_an_unsigned_hold_is_not_held() -> None:
    sched = scheduler()
    req = request("p-1", {"do_remote_decode": True, tickets.HANDOFF: "b" * 32})
    sched.allocated(req, Blocks([1]), 0)
    assert sched.finished(req, ([1],)) == (False, None)
    assert not sched.step(NOTHING_NEW).step.sends


def test_a_release_names_this_engines_own_held_ticket() -> None:
    sched = scheduler()
    req = request("p-1", {"do_remote_decode": True})
    sched.allocated(req, Blocks([1]), 0)
    _, params = sched.finished(req, ([1],))
    key = tickets.read_held(KEY, params).handoff_id
    sched.step(NOTHING_NEW)
    forged = {**tickets.release_params(params), tickets.PREFILL_REQUEST: "c" * 32}
    for params_sent in (forged, tickets.release_params(params)):
        assert sched.matched(request("p-2", params_sent, tokens=1), 0) == (0, False)
    assert sched.step(NOTHING_NEW).step.released == {key}


anything = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=40)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
keys = st.sampled_from(sorted(HELD_FIELDS | {tickets.HANDOFF, tickets.RELEASE}))


@settings(max_examples=300, deadline=None)
@given(st.one_of(anything, st.dictionaries(keys, anything, max_size=9)))
def test_no_kv_transfer_params_raise_inside_the_scheduler(params: Any) -> None:
    sched = scheduler()
    req = request("r-1", params)
    count, _ = sched.matched(req, 0)
    sched.allocated(req, Blocks([1, 2, 3]), count)
    sched.step(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, preempted_req_ids={"r-1"}))
    sched.finished(req, ([1, 2, 3],))
    sched.step(NOTHING_NEW)


def test_a_load_that_ends_before_its_blocks_are_allocated_is_withdrawn() -> None:
    handoff = tickets.mint_handoff_id()
    sched = ConnectorScheduler("vllm-d", BLOCK_SIZE, KEY)
    req = request("d-1", tickets.load_params(KEY, "vllm-p", handoff))
    assert sched.matched(req, 0) == (40, True)  # no blocks free yet: it waits, then is aborted
    sched.finished(req, ())
    (withdrawn,) = sched.step(NOTHING_NEW).step.withdrawn
    assert (withdrawn.prefill_engine, withdrawn.prefill_request_id) == ("vllm-p", handoff)
    # A load that began is not withdrawn (its worker releases it), nor is a forged one.
    for params in (
        tickets.load_params(KEY, "vllm-p", handoff),
        {"do_remote_prefill": True, tickets.HANDOFF: handoff},
    ):
        other = request("d-2", params)
        run_decode(sched, other)
        sched.finished(other, ([3, 4, 5],))
        assert sched.step(NOTHING_NEW).step.withdrawn == []


class GroupBlocks:
    """What vLLM's hybrid KV cache manager allocates: a list of block ids per KV cache group."""

    def __init__(self, *groups: list[int]) -> None:
        self.groups = groups

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.groups


def test_several_kv_cache_groups_keep_their_blocks_apart_and_nulls_hold_no_block() -> None:
    """A sliding-window group and a full-attention group (HMA): each side's block table has a
    row per group; vLLM's null block 0 (a window's past) is no block; the decode side's rows
    start at its first block to load (its own prefix cache before it)."""
    prefill = scheduler()
    held = request("p-1", {"do_remote_decode": True}, tokens=40)
    prefill.allocated(held, GroupBlocks([5, 6, 7], [8, 9, 10]), 0)
    delay, params = prefill.finished(held, ([0, 6, 7], [8, 9, 10]))
    assert delay and params is not None
    (send,) = prefill.step(NOTHING_NEW).step.sends.values()
    assert send.block_ids == ((NO_BLOCK, 6, 7), (8, 9, 10))

    decode = ConnectorScheduler("vllm-d", BLOCK_SIZE, KEY)
    load = request("d-1", dict(params), tokens=40)
    count, _ = decode.matched(load, BLOCK_SIZE)  # its first block is in its own prefix cache
    assert count == 40 - BLOCK_SIZE
    decode.allocated(load, GroupBlocks([0, 3, 4], [1, 2, 11]), count)
    spec = decode.step(NOTHING_NEW).step.loads["d-1"]
    assert spec.first_block == 1
    assert spec.block_ids == ((3, 4), (2, 11))


def test_kv_cache_groups_of_different_block_sizes_are_refused_at_start_up() -> None:
    def config(*sizes: int) -> SimpleNamespace:
        groups = [SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=size)) for size in sizes]
        return SimpleNamespace(kv_cache_groups=groups)

    assert block_size_of(config(128, 128), 16) == 128  # the platform's size, not the configured one
    assert block_size_of(None, 16) == 16
    with pytest.raises(ConfigError, match="one block size"):
        block_size_of(config(16, 128), 16)


def test_a_held_ticket_expires_with_the_lease_and_a_decode_first_hold_binds_its_decode_engine() -> None:
    sched = ConnectorScheduler("vllm-p", BLOCK_SIZE, KEY, lease_s=5.0)
    sched.handshake = KvrayHandshake("vllm-p", 5, "node-1", "/dev/shm/kvray-inbox")
    req = request("p-1", {"do_remote_decode": True})
    sched.allocated(req, Blocks([1]), 0)
    _, params = sched.finished(req, ([1],))
    assert time.time() + 5 <= params[tickets.EXPIRES] <= time.time() + 7
    handoff = tickets.mint_handoff_id()
    bound = request("p-2", tickets.hold_params(KEY, handoff, decode_engine="vllm-d"))
    sched.allocated(bound, Blocks([2]), 0)
    sched.finished(bound, ([2],))
    sends = sched.step(NOTHING_NEW).step.sends
    assert {spec.key: spec.decode_engine for spec in sends.values()}[handoff] == "vllm-d"


def test_a_decode_engine_refuses_a_ticket_for_another_decode_engine() -> None:
    handoff = tickets.mint_handoff_id()
    decode = ConnectorScheduler("vllm-d", BLOCK_SIZE, KEY)
    _, _, meta = run_decode(
        decode, request("d-1", tickets.load_params(KEY, "vllm-p", handoff, decode_engine="vllm-x"))
    )
    assert "vllm-x" in meta.step.loads["d-1"].refusal
    _, _, meta = run_decode(
        decode, request("d-2", tickets.load_params(KEY, "vllm-p", handoff, decode_engine="vllm-d"))
    )
    assert not meta.step.loads["d-2"].refusal


#: Any JSON value, text of any code point (lone surrogates and non-ASCII included).
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False),
        st.text(st.characters(codec=None), max_size=70),
        st.sampled_from(["é" * 64, "\ud800" * 64, "0" * 64, "a" * 32, ""]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=5,
)
_HELD = tickets.Held(
    engine="vllm-p",
    incarnation=5,
    handoff_id=tickets.mint_handoff_id(),
    node="node-1",
    inbox="/x",
    expires=2**40,
)
genuine = [
    tickets.hold_params(KEY, tickets.mint_handoff_id()),
    tickets.hold_params(KEY, tickets.mint_handoff_id(), decode_engine="vllm-d"),
    tickets.load_params(KEY, "vllm-p", tickets.mint_handoff_id()),
    tickets.held_params(KEY, _HELD),
    tickets.release_params(tickets.held_params(KEY, _HELD)),
]
kvray_fields = sorted(
    HELD_FIELDS | {tickets.HANDOFF, tickets.RELEASE, tickets.PREFILL_RANKS, tickets.DECODE_ENGINE}
)


@settings(max_examples=1000, deadline=None)
@given(
    st.sampled_from(genuine),
    st.dictionaries(st.sampled_from(kvray_fields), json_values, min_size=1, max_size=3),
)
def test_every_kvray_field_of_a_genuine_ticket_set_to_any_json_value_raises_nothing(
    params: dict[str, Any], changes: dict[str, Any]
) -> None:
    """A genuine ticket of each kind with any of kvray's fields set to any JSON value (what a
    client can send), through every scheduler hook, on a prefill and a decode engine: nothing
    raises, and a load vLLM waits for is issued (refused, or by a ticket that verified)."""
    altered = json.loads(json.dumps({**params, **changes}))
    for sched in (scheduler(), ConnectorScheduler("vllm-d", BLOCK_SIZE, KEY)):
        req = request("r-1", altered)
        count, asynchronous = sched.matched(req, 0)
        sched.allocated(req, Blocks([1, 2, 3]), count)
        meta = sched.step(NOTHING_NEW)
        assert not asynchronous or "r-1" in meta.step.loads
        sched.finished(req, ([1, 2, 3],))
        sched.step(NOTHING_NEW)


class _Broken:
    """A scheduler side whose every reader fails unexpectedly."""

    def __init__(self) -> None:
        self.inner = ConnectorScheduler("vllm-d", BLOCK_SIZE, KEY)

    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self.inner.matched(request, num_computed_tokens)
        raise RuntimeError("unexpected")

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        raise RuntimeError("unexpected")

    def finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        raise RuntimeError("unexpected")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_an_unexpected_error_in_a_hook_ends_as_that_requests_failure_not_the_engines() -> None:
    connector = KvrayConnector.__new__(KvrayConnector)
    broken = _Broken()
    connector._scheduler = broken  # type: ignore[assignment]
    req = request("d-1", tickets.load_params(KEY, "vllm-p", tickets.mint_handoff_id()))
    assert connector.get_num_new_matched_tokens(req, 0) == (0, False)  # computed here instead
    # A load vLLM was promised (the match ran before the error): it fails at once.
    broken.inner.matched(req, 0)
    connector.update_state_after_alloc(req, Blocks([3, 4, 5]), 40)
    spec = broken.inner.step(NOTHING_NEW).step.loads["d-1"]
    assert spec.refusal and spec.block_ids == ((3, 4, 5),)
    assert connector.request_finished(req, [3, 4, 5]) == (False, None)
