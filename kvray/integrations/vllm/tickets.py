"""Hand-off tickets: the kvray fields of vLLM's `kv_transfer_params`, read and written.

`kv_transfer_params` arrive in a request's HTTP body, so they are client input. kvray reads
nothing from them that it did not write: every set of fields that names a hand-off carries a
tag, HMAC-SHA256 under the hand-off key that the engines of one deployment (and the
orchestrator in front of them) share, over the fields it vouches for. Hand-off ids are minted
here (random, 128 bits), never taken from a client's request id.

    kind     written by                       fields vouched for
    hold     orchestrator, to the prefill     hand-off id, decode engine       (decode first)
    load     orchestrator, to the decode      prefill engine, id, decode engine (decode first)
    held     prefill engine, as it finishes   engine, incarnation, id, node, push inbox,
                                              and each further TP rank's incarnation and inbox
             (its answer's kv_transfer_params; the proxy gives it to the decode engine)
    release  prefill engine, beside `held`    the held fields: the proxy alone keeps it (it
             (`kvray_release_tag`)             strips it from the decode leg) and sends it back
                                              with `kvray_release` when the decode leg failed

Every ticket carries its expiry (`kvray_expires`, Unix seconds, under the tag): a `held`
ticket lives as long as the prefill engine's lease, the orchestrator's `TICKET_TTL_S`, so a
ticket copied from a log is worth nothing soon after. Where the orchestrator knows the decode
engine (decode first), both its tickets name it: the decode engine loads only a ticket naming
itself, and the prefill engine pushes the request only into that engine's reservations.

The ticket vouches for the request's fields; `ask_proof` vouches for the engines' own messages
about a hand-off (a decode engine's push request or withdrawal), so no one without the key
can free or pin another request's hold by knowing its hand-off id.

A malformed, unsigned or expired set raises `TicketError`, whatever the types of its values;
the connector never lets anything reach vLLM's scheduler as an exception (a load becomes a
load error, a hold is not held).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
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
#: Beside a `held` ticket, the tag that lets its holder release it (the proxy keeps it).
RELEASE_TAG = "kvray_release_tag"
#: When a ticket stops being honoured (Unix seconds), under its tag.
EXPIRES = "kvray_expires"
#: The decode engine a decode-first ticket is for ("" or absent: any engine of the deployment).
DECODE_ENGINE = "kvray_decode_engine"

#: How long an orchestrator's `hold` and `load` tickets are honoured (seconds): a request may
#: wait in an engine's queue before its scheduler reads them.
TICKET_TTL_S = 600
#: How far apart the clocks of the machines that write and read a ticket may be (seconds).
CLOCK_SKEW_S = 30

#: A hand-off key is at least this many random bytes (given as twice as many hex digits).
KEY_NBYTES = 32
_HANDOFF_ID = re.compile(r"[0-9a-f]{32}")
_TAG_TEXT = re.compile(r"[0-9a-f]{64}")
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
        message = msgspec.msgpack.encode(("kvray-ticket-2", kind, *fields))
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def verify(self, params: Mapping[str, Any], kind: str, *fields: str | int, name: str = TAG) -> None:
        """Raise `TicketError` unless `params[name]` is the tag of `kind` over `fields`. The tag
        is checked to be hex digits before it is compared: `hmac.compare_digest` raises on a
        string that is not ASCII, and a client chooses this one."""
        tag = params.get(name)
        if (
            not isinstance(tag, str)
            or _TAG_TEXT.fullmatch(tag) is None
            or not hmac.compare_digest(tag, self.tag(kind, *fields))
        ):
            raise TicketError(
                f"the request's kv_transfer_params ({kind}) are not signed by this deployment's "
                "hand-off key: only the P/D proxy or orchestrator may set kvray's fields",
                kind=kind,
            )

    def ask_proof(self, prefill_engine: str, handoff_id: str) -> bytes:
        """What a decode engine's push request or withdrawal for hand-off `handoff_id` at
        `prefill_engine` carries to show it comes from an engine of this deployment
        (`kvray.agent.handoff.AskProof`)."""
        message = msgspec.msgpack.encode(("kvray-ask-1", prefill_engine, handoff_id))
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    def lane_key(
        self, prefill_engine: str, prefill_incarnation: int, decode_engine: str, decode_incarnation: int
    ) -> bytes:
        """The 16-byte key a decode engine's asks through a prefill engine's native lane are
        MAC'd under (`kvray.agent.lane`): one per pair of incarnations."""
        message = msgspec.msgpack.encode(
            ("kvray-lane-1", prefill_engine, prefill_incarnation, decode_engine, decode_incarnation)
        )
        return hmac.new(self._secret, message, hashlib.sha256).digest()[:16]


def new_key_hex() -> str:
    """A fresh hand-off key, as hex digits."""
    return secrets.token_hex(KEY_NBYTES)


def key_from(extra: Mapping[str, Any], environ_key: str | None) -> HandoffKey:
    """The hand-off key of a connector: `kv_connector_extra_config`'s `handoff_key` (which vLLM
    prints in its start-up log), else the file its `handoff_key_file` names, else the
    environment's (`KVRAY_HANDOFF_KEY`); the last two keep the key out of every log. Without
    any, kvray refuses to start rather than trust client fields."""
    if extra.get("handoff_key") is not None:
        return HandoffKey.from_hex(extra["handoff_key"], "kv_connector_extra_config handoff_key")
    if extra.get("handoff_key_file") is not None:
        return key_from_file(extra["handoff_key_file"])
    if environ_key is not None:
        return HandoffKey.from_hex(environ_key, HANDOFF_KEY_VARIABLE)
    raise ConfigError(
        "KvrayConnector needs the hand-off key its prefill and decode engines share: set "
        f"{HANDOFF_KEY_VARIABLE} (or kv_connector_extra_config handoff_key_file, a file holding "
        f"it) to the same {2 * KEY_NBYTES} hex digits on every engine of the deployment "
        "(python -c 'import secrets; print(secrets.token_hex(32))')"
    )


#: A key file holds the hex digits and perhaps a newline; anything much longer is not one.
_MAX_KEY_FILE = 1024


def key_from_file(path: object) -> HandoffKey:
    """The hand-off key in the file at `path` (hex digits; readable by its owner alone)."""
    import os
    import stat

    source = "kv_connector_extra_config handoff_key_file"
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{source} must be a file's path")
    try:
        with open(path, "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            text = file.read(_MAX_KEY_FILE + 1)
    except OSError as error:
        raise ConfigError(f"{source} {path!r} cannot be read: {error}") from error
    if not stat.S_ISREG(mode) or mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{source} {path!r} must be a regular file only its owner may read (chmod 600 {path})"
        )
    if len(text) > _MAX_KEY_FILE:
        raise ConfigError(f"{source} {path!r} holds more than a hand-off key")
    try:
        digits = text.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{source} {path!r} does not hold hex digits") from None
    return HandoffKey.from_hex(digits, f"{source} {path!r}")


def mint_handoff_id() -> str:
    """A fresh hand-off id (128 random bits, hex)."""
    return secrets.token_hex(16)


@dataclass(frozen=True)
class Held:
    """Where a prefill engine holds a finished request (a `held` ticket's fields)."""

    engine: str
    incarnation: int
    handoff_id: str
    node: str
    inbox: str
    #: The engine's further tensor-parallel ranks (1, 2, ...): each one's incarnation and push
    #: inbox (`kvray.agent.handoff.LoadSpec.prefill_ranks`).
    ranks: tuple[tuple[int, str], ...] = ()
    #: When the ticket stops being honoured (Unix seconds): the end of the request's lease.
    expires: int = 0

    def signed_fields(self) -> tuple[str | int, ...]:
        """The fields the ticket's tag vouches for."""
        fields: list[str | int] = [self.engine, self.incarnation, self.handoff_id, self.node, self.inbox]
        for incarnation, inbox in self.ranks:
            fields += [incarnation, inbox]
        fields.append(self.expires)
        return tuple(fields)


@dataclass(frozen=True)
class Hold:
    """A decode-first prefill leg's ticket: the hand-off id the orchestrator minted, and the
    decode engine it is for ("" where the orchestrator did not name one)."""

    handoff_id: str
    decode_engine: str = ""


@dataclass(frozen=True)
class Load:
    """What a decode engine may load from: the prefill engine and the hand-off id, and, when
    the prefill engine issued the ticket itself, its incarnation, node and push inbox."""

    engine: str
    handoff_id: str
    held: Held | None = None
    #: The decode engine the ticket is for ("": any engine of the deployment).
    decode_engine: str = ""


def expiry(ttl_s: float, now: float | None = None) -> int:
    """The `kvray_expires` of a ticket honoured for `ttl_s` seconds from now."""
    return int((time.time() if now is None else now) + ttl_s) + 1


def hold_params(
    key: HandoffKey, handoff_id: str, *, decode_engine: str = "", ttl_s: float = TICKET_TTL_S
) -> dict[str, Any]:
    """The prefill leg's kv_transfer_params when the decode engine (`decode_engine`, if the
    orchestrator knows it) is given the request first."""
    expires = expiry(ttl_s)
    return {
        "do_remote_decode": True,
        HANDOFF: handoff_id,
        DECODE_ENGINE: decode_engine,
        EXPIRES: expires,
        TAG: key.tag("hold", handoff_id, decode_engine, expires),
    }


def load_params(
    key: HandoffKey, engine: str, handoff_id: str, *, decode_engine: str = "", ttl_s: float = TICKET_TTL_S
) -> dict[str, Any]:
    """The decode leg's kv_transfer_params when it is given the request first."""
    expires = expiry(ttl_s)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        PREFILL_ENGINE: engine,
        HANDOFF: handoff_id,
        DECODE_ENGINE: decode_engine,
        EXPIRES: expires,
        TAG: key.tag("load", engine, handoff_id, decode_engine, expires),
    }


def held_params(key: HandoffKey, held: Held) -> dict[str, Any]:
    """A prefill engine's answer for a request it holds: what the decode leg needs, and the
    release tag that only the proxy keeps."""
    if held.expires <= 0:
        raise ValueError("a held ticket needs its expiry (Held.expires)")
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        PREFILL_ENGINE: held.engine,
        PREFILL_INCARNATION: held.incarnation,
        PREFILL_REQUEST: held.handoff_id,
        PREFILL_NODE: held.node,
        PREFILL_INBOX: held.inbox,
        EXPIRES: held.expires,
        TAG: key.tag("held", *held.signed_fields()),
        RELEASE_TAG: key.tag("release", *held.signed_fields()),
    }
    if held.ranks:
        params[PREFILL_RANKS] = [[incarnation, inbox] for incarnation, inbox in held.ranks]
    return params


def decode_leg_params(held: Mapping[str, Any]) -> dict[str, Any]:
    """A prefill engine's answer (`held_params`) as the decode leg gets it: without the release
    tag, so the decode engine (and its request log) cannot release the hold."""
    return {name: value for name, value in held.items() if name != RELEASE_TAG}


def release_params(held: Mapping[str, Any]) -> dict[str, Any]:
    """What to send the prefill engine that issued `held` (its answer's kv_transfer_params,
    release tag included) when the decode leg will not take the request: it drops the request
    at once."""
    return {**held, "do_remote_prefill": False, RELEASE: True}


def read_hold(key: HandoffKey, params: Mapping[str, Any], now: float | None = None) -> Hold | None:
    """The ticket of a prefill leg given first to a decode engine, or None when the params name
    no hand-off (the prefill engine mints its own id)."""
    if HANDOFF not in params:
        return None
    hold = Hold(
        handoff_id=_handoff_id(params.get(HANDOFF)),
        decode_engine=_text(params.get(DECODE_ENGINE, ""), DECODE_ENGINE, _MAX_NAME, empty=True),
    )
    expires = _expires(params.get(EXPIRES))
    key.verify(params, "hold", hold.handoff_id, hold.decode_engine, expires)
    _unexpired(expires, now)
    return hold


def read_load(key: HandoffKey, params: Mapping[str, Any], now: float | None = None) -> Load:
    """The decode leg's ticket: a prefill engine's `held` ticket, or the orchestrator's `load`."""
    if PREFILL_INCARNATION in params or PREFILL_REQUEST in params:
        held = read_held(key, params, now)
        return Load(engine=held.engine, handoff_id=held.handoff_id, held=held)
    engine = _text(params.get(PREFILL_ENGINE), PREFILL_ENGINE, _MAX_NAME)
    handoff_id = _handoff_id(params.get(HANDOFF))
    decode_engine = _text(params.get(DECODE_ENGINE, ""), DECODE_ENGINE, _MAX_NAME, empty=True)
    expires = _expires(params.get(EXPIRES))
    key.verify(params, "load", engine, handoff_id, decode_engine, expires)
    _unexpired(expires, now)
    return Load(engine=engine, handoff_id=handoff_id, decode_engine=decode_engine)


def read_held(key: HandoffKey, params: Mapping[str, Any], now: float | None = None) -> Held:
    """A prefill engine's own `held` ticket."""
    held = Held(
        engine=_text(params.get(PREFILL_ENGINE), PREFILL_ENGINE, _MAX_NAME),
        incarnation=_incarnation(params.get(PREFILL_INCARNATION)),
        handoff_id=_handoff_id(params.get(PREFILL_REQUEST)),
        node=_text(params.get(PREFILL_NODE), PREFILL_NODE, _MAX_NAME, empty=True),
        inbox=_text(params.get(PREFILL_INBOX), PREFILL_INBOX, _MAX_PATH, empty=True),
        ranks=_ranks(params.get(PREFILL_RANKS, [])),
        expires=_expires(params.get(EXPIRES)),
    )
    key.verify(params, "held", *held.signed_fields())
    _unexpired(held.expires, now)
    return held


def read_release(key: HandoffKey, params: Mapping[str, Any], now: float | None = None) -> Held:
    """A proxy's release of a prefill engine's own `held` ticket: the ticket and its release tag."""
    held = read_held(key, params, now)
    key.verify(params, "release", *held.signed_fields(), name=RELEASE_TAG)
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
    try:
        value.encode()  # a lone surrogate (JSON's "\ud800") cannot be signed or sent
    except UnicodeEncodeError:
        raise TicketError(f"kv_transfer_params {name} is not valid Unicode text") from None
    return value


def _handoff_id(value: object) -> str:
    if not isinstance(value, str) or _HANDOFF_ID.fullmatch(value) is None:
        raise TicketError("a kvray hand-off id is 32 lowercase hex digits, minted by kvray")
    return value


def _incarnation(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise TicketError(f"kv_transfer_params {PREFILL_INCARNATION} must be an integer in [0, 2**63)")
    return value


def _expires(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 63:
        raise TicketError(f"kv_transfer_params {EXPIRES} must be a positive integer (Unix seconds)")
    return value


def _unexpired(expires: int, now: float | None) -> None:
    now = time.time() if now is None else now
    if expires + CLOCK_SKEW_S < now:
        raise TicketError(
            f"the request's kvray ticket expired {now - expires:.0f} s ago: the hand-off it names is "
            "over (retry the request through the proxy or orchestrator)",
            expired_s=round(now - expires),
        )
