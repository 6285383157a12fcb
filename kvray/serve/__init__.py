"""kvray on Ray Serve: the reference application over the reference model (`app`), what any
engine's Serve deployment needs to host a kvray agent in its replicas (`host`; the agent itself
is a `kvray.host.forwarded.ForwardedAgent`), and how a driver serves until Ctrl-C or SIGTERM
(`signals`). Needs the `serve` extra.

Exported: what a user of the application deploys or configures. The application's internals
(request and reply schemas, error mapping, worker start-up) stay in `kvray.serve.app`."""

from kvray.serve.app import DecodeReplica, PrefillReplica, Router, ServeOptions, build_app
from kvray.serve.host import replica_engine_id
from kvray.serve.signals import wait_for_stop_signal

__all__ = [
    "DecodeReplica",
    "PrefillReplica",
    "Router",
    "ServeOptions",
    "build_app",
    "replica_engine_id",
    "wait_for_stop_signal",
]
