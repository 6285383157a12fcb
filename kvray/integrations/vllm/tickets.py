"""Hand-off tickets: the kvray fields of vLLM's `kv_transfer_params`, read and written.

`kv_transfer_params` arrive in a request's HTTP body, so they are client input. kvray reads
nothing from them that it did not write: every set of fields that names a hand-off carries a
tag, HMAC-SHA256 under the hand-off key that the engines of one deployment (and the
orchestrator in front of them) share, over the fields it vouches for. Hand-off ids are minted
here (random, 128 bits), never taken from a client's request id.

    kind     written by                       fields vouched for
    hold     orchestrator, to the prefill     hand-off id            (decode first)
    load     orchestrator, to the decode      prefill engine, id     (decode first)
    held     prefill engine, as it finishes   engine, incarnation, id, node, push inbox,
                                              and each further TP rank's incarnation and inbox
             (its answer's kv_transfer_params; the proxy gives it to the decode engine, or
             back to the prefill engine with `kvray_release` when the decode leg failed)

A malformed or unsigned set raises `TicketError`; the connector never lets that reach vLLM's
scheduler as an exception (a load becomes a load error, a hold is not held).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from kvray.config import HANDOFF_KEY_VARIABLE
from kvray.errors import ConfigError, TicketError

#: The kv_transfer_params keys kvray reads and writes.
PREFILL_ENGINE = "kvray_prefill_engine"
PREFILL_INCARNATION = "kvray_prefill_incarnation"
PREFILL_REQUEST = "kvray_prefill_request"
PREFILL_NODE = "kvray_prefill_node"
PREFILL_INBOX = "kvray_prefill_inbox"
#: A prefill engine of several tensor-parallel ranks: [incarnation, inbox] of ranks 1, 2, ...
PREFILL_RANKS = "kvray_prefill_ranks"
HANDOFF = "kvray_handoff"
TAG = "kvray_tag"
#: With a prefill engine's own `held` ticket, sent back to it: drop the held request now.
RELEASE = "kvray_release"

#: A hand-off key is at least this many random bytes (given as twice as many hex digits).
KEY_NBYTES = 32
_HANDOFF_ID = re.compile(r"[0-9a-f]{32}")
_MAX_NAME = 256
_MAX_PATH = 4096
#: Most tensor-parallel ranks a ticket names.
_MAX_RANKS = 64


class HandoffKey:
    """The secret the engines of one P/D deployment share; it signs and checks tickets."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        if len(secret) < KEY_NBYTES:
            raise ConfigError(f"a hand-off key has at least {KEY_NBYTES} bytes; this one has {len(secret)}")
        self._secret = bytes(secret)

    @classmethod
    def from_hex(cls, text: object, source: str = "handoff_key") -> HandoffKey:
        """A key from hex digits (`new_key_hex()` makes one)."""
        if not isinstance(text, str):
            raise ConfigError(f"{source} must be a string of hex digits, not {type(text).__name__}")
        try:
            secret = bytes.fromhex(text)
        except ValueError:
            raise ConfigError(f"{source} is not hex digits") from None
        if len(secret) < KEY_NBYTES:
            raise ConfigError(
                f"{source} has {len(secret)} bytes; use at least {KEY_NBYTES} random bytes "
                f"({2 * KEY_NBYTES} hex digits: python -c 'import secrets; print(secrets.token_hex(32))')"
            )
        return cls(secret)

    def __repr__(self) -> str:
        return "HandoffKey(<secret>)"

    def tag(self, kind: str, *fields: str | int) -> str:
        message = msgspec.msgpack.encode(("kvray-ticket-1", kind, *fields))
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def verify(self, params: Mapping[str, Any], kind: str, *fields: str | int) -> None:
        tag = params.get(TAG)
        if not isinstance(tag, str) or not hmac.compare_digest(tag, self.tag(kind, *fields)):
            raise TicketError(
                f"the request's kv_transfer_params ({kind}) are not signed by this deployment's "
                "hand-off key: only the P/D proxy or orchestrator may set kvray's fields",
                kind=kind,
            )


def new_key_hex() -> str:
    """A fresh hand-off key, as hex digits."""
    return secrets.token_hex(KEY_NBYTES)


def key_from(extra: Mapping[str, Any], environ_key: str | None) -> HandoffKey:
    """The hand-off key of a connector: `kv_connector_extra_config`'s `handoff_key`, else the
    environment's; without either, kvray refuses to start rather than trust client fields."""
    if extra.get("handoff_key") is not None:
        return HandoffKey.from_hex(extra["handoff_key"], "kv_connector_extra_config handoff_key")
    if environ_key is not None:
        return HandoffKey.from_hex(environ_key, HANDOFF_KEY_VARIABLE)
    raise ConfigError(
        "KvrayConnector needs the hand-off key its prefill and decode engines share: set "
        f"kv_connector_extra_config handoff_key or {HANDOFF_KEY_VARIABLE} to the same "
        f"{2 * KEY_NBYTES} hex digits on every engine of the deployment (python -c 'import "
        "secrets; print(secrets.token_hex(32))')"
    )


def mint_handoff() -> str:
    """A fresh hand-off id (128 random bits, hex)."""
    return secrets.token_hex(16)


@dataclass(frozen=True)
class Held:
    """Where a prefill engine holds a finished request (a `held` ticket's fields)."""

    engine: str
    incarnation: int
    request: str
    node: str
    inbox: str
    #: The engine's further tensor-parallel ranks (1, 2, ...): each one's incarnation and push
    #: inbox (`kvray.agent.handoff.LoadSpec.prefill_ranks`).
    ranks: tuple[tuple[int, str], ...] = ()

    def signed_fields(self) -> tuple[str | int, ...]:
        """The fields the ticket's tag vouches for (an engine of one rank: as before ranks)."""
        fields: list[str | int] = [self.engine, self.incarnation, self.request, self.node, self.inbox]
        for incarnation, inbox in self.ranks:
            fields += [incarnation, inbox]
        return tuple(fields)


@dataclass(frozen=True)
class Load:
    """What a decode engine may load from: the prefill engine and the hand-off id, and, when
    the prefill engine issued the ticket itself, its incarnation, node and push inbox."""

    engine: str
    request: str
    held: Held | None = None


def hold_params(key: HandoffKey, handoff: str) -> dict[str, Any]:
    """The prefill leg's kv_transfer_params when the decode engine is given the request first."""
    return {"do_remote_decode": True, HANDOFF: handoff, TAG: key.tag("hold", handoff)}


def load_params(key: HandoffKey, engine: str, handoff: str) -> dict[str, Any]:
    """The decode leg's kv_transfer_params when it is given the request first."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        PREFILL_ENGINE: engine,
        HANDOFF: handoff,
        TAG: key.tag("load", engine, handoff),
    }


def held_params(key: HandoffKey, held: Held) -> dict[str, Any]:
    """A prefill engine's answer for a request it holds: what the decode leg needs, no more."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        PREFILL_ENGINE: held.engine,
        PREFILL_INCARNATION: held.incarnation,
        PREFILL_REQUEST: held.request,
        PREFILL_NODE: held.node,
        PREFILL_INBOX: held.inbox,
        TAG: key.tag("held", *held.signed_fields()),
    }
    if held.ranks:
        params[PREFILL_RANKS] = [[incarnation, inbox] for incarnation, inbox in held.ranks]
    return params


def release_params(held: Mapping[str, Any]) -> dict[str, Any]:
    """What to send the prefill engine that issued `held` (its answer's kv_transfer_params)
    when the decode leg will not take the request: it drops the request at once."""
    return {**held, "do_remote_prefill": False, RELEASE: True}


def read_hold(key: HandoffKey, params: Mapping[str, Any]) -> str | None:
    """The hand-off id of a prefill leg given first to a decode engine, or None when the
    params name none (the prefill engine mints its own)."""
    if HANDOFF not in params:
        return None
    handoff = _handoff(params.get(HANDOFF))
    key.verify(params, "hold", handoff)
    return handoff


def read_load(key: HandoffKey, params: Mapping[str, Any]) -> Load:
    """The decode leg's ticket: a prefill engine's `held` ticket, or the orchestrator's `load`."""
    if PREFILL_INCARNATION in params or PREFILL_REQUEST in params:
        held = read_held(key, params)
        return Load(engine=held.engine, request=held.request, held=held)
    engine = _text(params.get(PREFILL_ENGINE), PREFILL_ENGINE, _MAX_NAME)
    handoff = _handoff(params.get(HANDOFF))
    key.verify(params, "load", engine, handoff)
    return Load(engine=engine, request=handoff)


def read_held(key: HandoffKey, params: Mapping[str, Any]) -> Held:
    """A prefill engine's own `held` ticket."""
    held = Held(
        engine=_text(params.get(PREFILL_ENGINE), PREFILL_ENGINE, _MAX_NAME),
        incarnation=_incarnation(params.get(PREFILL_INCARNATION)),
        request=_handoff(params.get(PREFILL_REQUEST)),
        node=_text(params.get(PREFILL_NODE), PREFILL_NODE, _MAX_NAME, empty=True),
        inbox=_text(params.get(PREFILL_INBOX), PREFILL_INBOX, _MAX_PATH, empty=True),
        ranks=_ranks(params.get(PREFILL_RANKS, [])),
    )
    key.verify(params, "held", *held.signed_fields())
    return held


def _ranks(value: object) -> tuple[tuple[int, str], ...]:
    if not isinstance(value, list) or len(value) >= _MAX_RANKS:
        raise TicketError(
            f"kv_transfer_params {PREFILL_RANKS} must be a list of fewer than {_MAX_RANKS} ranks"
        )
    ranks: list[tuple[int, str]] = []
    for rank in value:
        if not isinstance(rank, (list, tuple)) or len(rank) != 2:
            raise TicketError(f"kv_transfer_params {PREFILL_RANKS} holds [incarnation, inbox] pairs")
        ranks.append((_incarnation(rank[0]), _text(rank[1], PREFILL_RANKS, _MAX_PATH, empty=True)))
    return tuple(ranks)


def _text(value: object, name: str, limit: int, *, empty: bool = False) -> str:
    if not isinstance(value, str) or len(value) > limit or (not value and not empty):
        raise TicketError(f"kv_transfer_params {name} must be a string of at most {limit} characters")
    return value


def _handoff(value: object) -> str:
    if not isinstance(value, str) or _HANDOFF_ID.fullmatch(value) is None:
        raise TicketError("a kvray hand-off id is 32 lowercase hex digits, minted by kvray")
    return value


def _incarnation(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise TicketError(f"kv_transfer_params {PREFILL_INCARNATION} must be an integer in [0, 2**63)")
    return value
