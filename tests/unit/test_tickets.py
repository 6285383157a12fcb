"""Hand-off tickets (`kvray.integrations.vllm.tickets`): what a proxy, an orchestrator or a
prefill engine signs verifies, and anything else a client could put in kv_transfer_params —
forged, altered, expired, of the wrong type — is a `TicketError`, never another exception."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
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
    Hold,
)

KEY = HandoffKey.from_hex(tickets.new_key_hex())
OTHER = HandoffKey.from_hex(tickets.new_key_hex())
HELD = Held(
    engine="vllm-p",
    incarnation=7,
    handoff_id=tickets.mint_handoff_id(),
    node="n1",
    inbox="/dev/shm/kvray-x",
    expires=tickets.expiry(7 * 24 * 3600),  # outlives any test run: tests of expiry pass `now`
)


def test_minted_ids_are_fresh_and_hand_off_shaped() -> None:
    ids = {tickets.mint_handoff_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(handoff) == 32 and int(handoff, 16) >= 0 for handoff in ids)


def test_each_kind_of_ticket_reads_back_what_was_signed() -> None:
    handoff = tickets.mint_handoff_id()
    assert tickets.read_hold(KEY, tickets.hold_params(KEY, handoff)) == Hold(handoff)
    assert tickets.read_hold(KEY, tickets.hold_params(KEY, handoff, decode_engine="vllm-d")) == Hold(
        handoff, "vllm-d"
    )
    load = tickets.read_load(KEY, tickets.load_params(KEY, "vllm-p", handoff))
    assert (load.engine, load.handoff_id, load.held, load.decode_engine) == ("vllm-p", handoff, None, "")
    load = tickets.read_load(KEY, tickets.load_params(KEY, "vllm-p", handoff, decode_engine="vllm-d"))
    assert load.decode_engine == "vllm-d"
    load = tickets.read_load(KEY, tickets.held_params(KEY, HELD))
    assert load.held == HELD and load.handoff_id == HELD.handoff_id
    assert tickets.read_release(KEY, tickets.release_params(tickets.held_params(KEY, HELD))) == HELD
    assert tickets.read_hold(KEY, {"do_remote_decode": True}) is None  # the engine mints its own


def test_a_ticket_is_only_its_own_kind() -> None:
    handoff = tickets.mint_handoff_id()
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
        {tickets.EXPIRES: HELD.expires + 3600},
        {TAG: "0" * 64},
        {TAG: None},
        {TAG: "é" * 64},
        {TAG: "\ud800" * 64},
    ],
)
def test_an_altered_ticket_is_refused(change: dict[str, Any]) -> None:
    with pytest.raises(TicketError):
        tickets.read_load(KEY, {**tickets.held_params(KEY, HELD), **change})


#: A prefill engine of three tensor-parallel ranks: ranks 1 and 2 named after rank 0.
HELD_TP = Held(
    engine="vllm-p",
    incarnation=7,
    handoff_id=tickets.mint_handoff_id(),
    node="n1",
    inbox="/dev/shm/kvray-x",
    ranks=((8, "/dev/shm/kvray-y"), (9, "/dev/shm/kvray-z")),
    expires=tickets.expiry(7 * 24 * 3600),  # outlives any test run: tests of expiry pass `now`
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
    handoff = tickets.mint_handoff_id()
    for params in (
        tickets.load_params(OTHER, "vllm-p", handoff),
        {"do_remote_prefill": True, PREFILL_ENGINE: "vllm-p", HANDOFF: handoff, tickets.EXPIRES: 2**40},
    ):
        with pytest.raises(TicketError, match="not signed"):
            tickets.read_load(KEY, params)
    with pytest.raises(TicketError):
        tickets.read_hold(KEY, {"do_remote_decode": True, HANDOFF: handoff})


def test_a_client_request_id_is_not_a_hand_off_id() -> None:
    with pytest.raises(TicketError, match="32 lowercase hex"):
        params = {"do_remote_decode": True, HANDOFF: "dup-big", TAG: KEY.tag("hold", "dup-big")}
        tickets.read_hold(KEY, params)


def test_a_ticket_is_honoured_until_it_expires_give_or_take_the_clocks_skew() -> None:
    handoff = tickets.mint_handoff_id()
    hold = tickets.hold_params(KEY, handoff, ttl_s=60)
    load = tickets.load_params(KEY, "vllm-p", handoff, ttl_s=60)
    held = tickets.held_params(KEY, HELD)
    expires = hold[tickets.EXPIRES]
    assert time.time() + 60 <= expires <= time.time() + 62
    for now in (time.time(), expires + tickets.CLOCK_SKEW_S - 1):
        tickets.read_hold(KEY, hold, now)
        tickets.read_load(KEY, load, now)
    tickets.read_held(KEY, held, HELD.expires + tickets.CLOCK_SKEW_S - 1)
    later = expires + tickets.CLOCK_SKEW_S + 1
    for read, params in ((tickets.read_hold, hold), (tickets.read_load, load)):
        with pytest.raises(TicketError, match="expired"):
            read(KEY, params, later)
    with pytest.raises(TicketError, match="expired"):
        tickets.read_load(KEY, held, HELD.expires + tickets.CLOCK_SKEW_S + 1)
    # Without an expiry, or with one made up: refused.
    for params in (hold, load, held):
        without = {name: value for name, value in params.items() if name != tickets.EXPIRES}
        with pytest.raises(TicketError):
            tickets.read_load(KEY, without) if params is not hold else tickets.read_hold(KEY, without)
    with pytest.raises(ValueError):
        tickets.held_params(KEY, Held(engine="e", incarnation=1, handoff_id=handoff, node="", inbox=""))


def test_only_the_proxy_can_release_the_decode_leg_sees_no_release_tag() -> None:
    held = tickets.held_params(KEY, HELD)
    decode_leg = tickets.decode_leg_params(held)
    assert tickets.RELEASE_TAG in held and tickets.RELEASE_TAG not in decode_leg
    assert tickets.read_load(KEY, decode_leg).held == HELD  # the decode engine loads by it
    with pytest.raises(TicketError):  # ... but cannot release the hold with it
        tickets.read_release(KEY, tickets.release_params(decode_leg))
    with pytest.raises(TicketError):  # nor with the held tag where the release tag goes
        tickets.read_release(KEY, {**tickets.release_params(decode_leg), tickets.RELEASE_TAG: held[TAG]})
    assert tickets.read_release(KEY, tickets.release_params(held)) == HELD


def test_a_decode_first_ticket_names_its_decode_engine_under_the_tag() -> None:
    handoff = tickets.mint_handoff_id()
    for params, read in (
        (tickets.hold_params(KEY, handoff, decode_engine="vllm-d"), tickets.read_hold),
        (tickets.load_params(KEY, "vllm-p", handoff, decode_engine="vllm-d"), tickets.read_load),
    ):
        for other in ("vllm-x", ""):
            with pytest.raises(TicketError):
                read(KEY, {**params, tickets.DECODE_ENGINE: other})


def test_an_ask_proof_names_its_key_engine_and_hand_off() -> None:
    handoff = tickets.mint_handoff_id()
    proof = KEY.ask_proof("vllm-p", handoff)
    assert len(proof) == 32 and proof == KEY.ask_proof("vllm-p", handoff)
    assert proof not in (
        OTHER.ask_proof("vllm-p", handoff),
        KEY.ask_proof("vllm-p-tp1", handoff),
        KEY.ask_proof("vllm-p", tickets.mint_handoff_id()),
    )


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
    for read in (tickets.read_load, tickets.read_hold, tickets.read_held, tickets.read_release):
        with contextlib.suppress(TicketError):
            read(KEY, params)


#: Any JSON value (what an HTTP body's kv_transfer_params can hold), text of any code point.
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False),
        st.text(st.characters(codec=None), max_size=70),
        st.sampled_from(["é" * 64, "\ud800" * 64, "0" * 64, "a" * 32, "\x00"]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=5,
)
genuine = [
    tickets.hold_params(KEY, tickets.mint_handoff_id(), decode_engine="vllm-d"),
    tickets.load_params(KEY, "vllm-p", tickets.mint_handoff_id()),
    tickets.held_params(KEY, HELD_TP),
    tickets.release_params(tickets.held_params(KEY, HELD)),
]


@settings(max_examples=1500, deadline=None)
@given(st.sampled_from(genuine), st.data())
def test_a_genuine_ticket_with_any_field_set_to_any_json_value_is_a_ticket_error(
    params: dict[str, Any], data: st.DataObject
) -> None:
    """Every field of a genuine ticket (and the ones it lacks) set to any JSON value: the
    reader either reads the unchanged ticket or raises `TicketError`, never another error
    (a non-ASCII tag made `hmac.compare_digest` raise `TypeError` inside vLLM's scheduler)."""
    names = sorted(params.keys() | {HANDOFF, PREFILL_RANKS, tickets.DECODE_ENGINE, tickets.EXPIRES})
    changes = data.draw(st.dictionaries(st.sampled_from(names), json_values, min_size=1, max_size=3))
    # Through JSON, as an HTTP body carries it: what vLLM's server hands the scheduler.
    altered = json.loads(json.dumps({**params, **changes}))
    for read in (tickets.read_load, tickets.read_hold, tickets.read_held, tickets.read_release):
        with contextlib.suppress(TicketError):
            read(KEY, altered)


@pytest.mark.parametrize("text", ["", "zz" * 32, "ab" * 31, 12, None])
def test_a_short_or_malformed_key_is_a_config_error(text: object) -> None:
    with pytest.raises(ConfigError):
        HandoffKey.from_hex(text)


def test_a_connector_without_a_key_does_not_start() -> None:
    with pytest.raises(ConfigError, match="KVRAY_HANDOFF_KEY"):
        tickets.key_from({}, None)
    assert repr(tickets.key_from({}, tickets.new_key_hex())) == "HandoffKey(<secret>)"


def test_a_key_file_is_read_only_when_its_owner_alone_may_read_it(tmp_path: Path) -> None:
    digits = tickets.new_key_hex()
    path = tmp_path / "handoff.key"
    path.write_text(digits + "\n")
    os.chmod(path, 0o600)
    key = tickets.key_from({"handoff_key_file": str(path)}, None)
    assert key.tag("hold", "x") == HandoffKey.from_hex(digits).tag("hold", "x")
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        tickets.key_from({"handoff_key_file": str(path)}, None)
    os.chmod(path, 0o600)
    path.write_text(digits * 40)
    with pytest.raises(ConfigError, match="more than a hand-off key"):
        tickets.key_from({"handoff_key_file": str(path)}, None)
    for bad in (str(tmp_path / "missing"), str(tmp_path), 5, ""):
        with pytest.raises(ConfigError):
            tickets.key_from({"handoff_key_file": bad}, None)
