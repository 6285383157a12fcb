"""Hand-off tickets (`kvray.integrations.vllm.tickets`): what a proxy, an orchestrator or a
prefill engine signs verifies, and anything else a client could put in kv_transfer_params —
forged, altered, of the wrong type — is a `TicketError`, never another exception."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.errors import ConfigError, TicketError
from kvray.integrations.vllm import tickets
from kvray.integrations.vllm.tickets import (
    HANDOFF,
    PREFILL_ENGINE,
    PREFILL_INBOX,
    PREFILL_INCARNATION,
    PREFILL_NODE,
    PREFILL_RANKS,
    PREFILL_REQUEST,
    TAG,
    HandoffKey,
    Held,
)

KEY = HandoffKey.from_hex(tickets.new_key_hex())
OTHER = HandoffKey.from_hex(tickets.new_key_hex())
HELD = Held(
    engine="vllm-p", incarnation=7, request=tickets.mint_handoff(), node="n1", inbox="/dev/shm/kvray-x"
)


def test_minted_ids_are_fresh_and_hand_off_shaped() -> None:
    ids = {tickets.mint_handoff() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(handoff) == 32 and int(handoff, 16) >= 0 for handoff in ids)


def test_each_kind_of_ticket_reads_back_what_was_signed() -> None:
    handoff = tickets.mint_handoff()
    assert tickets.read_hold(KEY, tickets.hold_params(KEY, handoff)) == handoff
    load = tickets.read_load(KEY, tickets.load_params(KEY, "vllm-p", handoff))
    assert (load.engine, load.request, load.held) == ("vllm-p", handoff, None)
    load = tickets.read_load(KEY, tickets.held_params(KEY, HELD))
    assert load.held == HELD and load.request == HELD.request
    assert tickets.read_held(KEY, tickets.release_params(tickets.held_params(KEY, HELD))) == HELD
    assert tickets.read_hold(KEY, {"do_remote_decode": True}) is None  # the engine mints its own


def test_a_ticket_is_only_its_own_kind() -> None:
    handoff = tickets.mint_handoff()
    hold = tickets.hold_params(KEY, handoff)
    with pytest.raises(TicketError):  # a hold ticket does not open a load of the same id
        tickets.read_load(KEY, {**hold, PREFILL_ENGINE: "vllm-p"})


@pytest.mark.parametrize(
    "change",
    [
        {PREFILL_ENGINE: "vllm-other"},
        {PREFILL_INCARNATION: 8},
        {PREFILL_REQUEST: "f" * 32},
        {PREFILL_NODE: "n2"},
        {PREFILL_INBOX: "/tmp/attacker.sock"},
        {TAG: "0" * 64},
        {TAG: None},
    ],
)
def test_an_altered_ticket_is_refused(change: dict[str, Any]) -> None:
    with pytest.raises(TicketError):
        tickets.read_load(KEY, {**tickets.held_params(KEY, HELD), **change})


#: A prefill engine of three tensor-parallel ranks: ranks 1 and 2 named after rank 0.
HELD_TP = Held(
    engine="vllm-p",
    incarnation=7,
    request=tickets.mint_handoff(),
    node="n1",
    inbox="/dev/shm/kvray-x",
    ranks=((8, "/dev/shm/kvray-y"), (9, "/dev/shm/kvray-z")),
)


def test_a_tensor_parallel_engines_ticket_names_every_rank_and_one_of_one_rank_is_as_before() -> None:
    params = tickets.held_params(KEY, HELD_TP)
    assert params[PREFILL_RANKS] == [[8, "/dev/shm/kvray-y"], [9, "/dev/shm/kvray-z"]]
    assert tickets.read_held(KEY, params) == HELD_TP
    assert PREFILL_RANKS not in tickets.held_params(KEY, HELD)
    # A rank's inbox or incarnation altered, a rank added or dropped: not what was signed.
    for ranks in (
        [[8, "/tmp/attacker.sock"], [9, "/dev/shm/kvray-z"]],
        [[8, "/dev/shm/kvray-y"], [10, "/dev/shm/kvray-z"]],
        [[8, "/dev/shm/kvray-y"]],
        [[8, "/dev/shm/kvray-y"], [9, "/dev/shm/kvray-z"], [9, "/dev/shm/kvray-z"]],
    ):
        with pytest.raises(TicketError):
            tickets.read_held(KEY, {**params, PREFILL_RANKS: ranks})
    with pytest.raises(TicketError):  # one engine's ticket with ranks made up
        tickets.read_held(KEY, {**tickets.held_params(KEY, HELD), PREFILL_RANKS: [[8, "/tmp/x"]]})
    for malformed in ("x", [[8]], [["8", "/tmp/x"]], [[8, 9]], [[-1, "/tmp/x"]], [[8, "/tmp/x"]] * 64):
        with pytest.raises(TicketError):
            tickets.read_held(KEY, {**params, PREFILL_RANKS: malformed})


def test_a_ticket_signed_under_another_key_or_unsigned_is_refused() -> None:
    handoff = tickets.mint_handoff()
    for params in (
        tickets.load_params(OTHER, "vllm-p", handoff),
        {"do_remote_prefill": True, PREFILL_ENGINE: "vllm-p", HANDOFF: handoff},
    ):
        with pytest.raises(TicketError, match="not signed"):
            tickets.read_load(KEY, params)
    with pytest.raises(TicketError):
        tickets.read_hold(KEY, {"do_remote_decode": True, HANDOFF: handoff})


def test_a_client_request_id_is_not_a_hand_off_id() -> None:
    with pytest.raises(TicketError, match="32 lowercase hex"):
        params = {"do_remote_decode": True, HANDOFF: "dup-big", TAG: KEY.tag("hold", "dup-big")}
        tickets.read_hold(KEY, params)


values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=80),
    st.binary(max_size=40),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)
fields = st.sampled_from(
    [HANDOFF, PREFILL_ENGINE, PREFILL_INCARNATION, PREFILL_REQUEST, PREFILL_NODE, PREFILL_INBOX, TAG, "other"]
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(fields, values, max_size=8))
def test_anything_a_client_sends_is_a_ticket_error_or_nothing(params: dict[str, Any]) -> None:
    for read in (tickets.read_load, tickets.read_hold, tickets.read_held):
        with contextlib.suppress(TicketError):
            read(KEY, params)


@pytest.mark.parametrize("text", ["", "zz" * 32, "ab" * 31, 12, None])
def test_a_short_or_malformed_key_is_a_config_error(text: object) -> None:
    with pytest.raises(ConfigError):
        HandoffKey.from_hex(text)


def test_a_connector_without_a_key_does_not_start() -> None:
    with pytest.raises(ConfigError, match="KVRAY_HANDOFF_KEY"):
        tickets.key_from({}, None)
    assert repr(tickets.key_from({}, tickets.new_key_hex())) == "HandoffKey(<secret>)"
