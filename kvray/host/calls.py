"""The calls a peer may make on an agent, in one table (`PeerCall`): writes, notices, claims,
connection and push requests reach a decode or prefill agent through its host, and every host
gets its entry points from this table (`add_peer_calls`), never from a list of its own."""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvray.config import Settings

#: The bytes of a `ray`-transport write.
Payload = npt.NDArray[np.uint8]

#: A host's entry point for one call: `self` (the host), then the call's arguments.
HostMethod = Callable[..., Coroutine[Any, Any, Any]]

H = TypeVar("H", bound=type)


class PeerCall(enum.Enum):
    """One call a peer may make on an agent: `kvray_<name>` on the agent's host, served by the
    agent's method `agent_method` with the same arguments and answer.

    A host that forwards calls bounds each by `timeout_s`: a write carries its payload (the
    transfer deadline), every other call is a control message (the notice deadline). The
    coordinator's `kvray_watch` is not a peer call: each host answers it its own way."""

    agent_method: str
    arguments: tuple[tuple[str, Any], ...]
    returns: Any
    carries_payload: bool
    summary: str

    DELIVER = (
        "deliver",
        (("header", bytes), ("payload", Payload)),
        int,
        True,
        "A `ray`-transport write to a decode engine; answers the bytes written.",
    )
    NOTIFY = (
        "notify",
        (("message", bytes),),
        None,
        False,
        "A completion or failure notice from a writer on another node.",
    )
    CLAIM = (
        "claim",
        (("message", bytes),),
        None,
        False,
        "A writer on another node claims a request before its first one-sided write (`verbs`).",
    )
    CONNECT = (
        "accept_connection",
        (("request", bytes),),
        bytes,
        False,
        "A writer's RDMA connection request (`verbs`); answers this engine's queue pair.",
    )
    REQUEST_PUSH = (
        "request_push",
        (("message", bytes),),
        None,
        False,
        "A decode engine asks this prefill engine to push a request's KV (`kvray.wire.PushRequest`); "
        "the engine answers with the push itself, or a refusal.",
    )

    def __init__(
        self,
        agent_method: str,
        arguments: tuple[tuple[str, Any], ...],
        returns: Any,
        carries_payload: bool,
        summary: str,
    ) -> None:
        self.agent_method = agent_method
        self.arguments = arguments
        self.returns = returns
        self.carries_payload = carries_payload
        self.summary = summary

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # By name: forwarded calls cross processes, and a value holding types is no key to send.
        return getattr, (PeerCall, self.name)

    @property
    def host_method(self) -> str:
        """The entry point's name on a host: `kvray_deliver`, `kvray_request_push`, ..."""
        return f"kvray_{self.name.lower()}"

    def timeout_s(self, settings: Settings) -> float:
        return settings.transfer_timeout_s if self.carries_payload else settings.notify_timeout_s

    def signature(self) -> inspect.Signature:
        """The entry point's signature on a host (`self` first), as Ray reads it."""
        keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD
        parameters = [inspect.Parameter("self", keyword)]
        parameters += [inspect.Parameter(name, keyword, annotation=kind) for name, kind in self.arguments]
        return inspect.Signature(parameters, return_annotation=self.returns)


def add_peer_calls(cls: H, entry_point: Callable[[PeerCall], HostMethod]) -> H:
    """Give the host class `cls` one `kvray_<name>` method per peer call, made by
    `entry_point(call)` and named, typed and documented by the table (a subclass may still
    override one)."""
    for call in PeerCall:
        method = entry_point(call)
        method.__name__ = call.host_method
        method.__qualname__ = f"{cls.__qualname__}.{call.host_method}"
        method.__doc__ = call.summary
        method.__signature__ = call.signature()  # type: ignore[attr-defined]
        setattr(cls, call.host_method, method)
    return cls
