"""kvray on Ray Serve: the reference application over the reference model (`app`), and what any
engine's Serve deployment needs to host a kvray agent in its replicas (`host`; the agent itself
is a `kvray.host.forwarded.ForwardedAgent`). Needs the `serve` extra.

Exported: what a user of the application deploys or configures. The application's internals
(request and reply schemas, error mapping, worker start-up) stay in `kvray.serve.app`."""

from kvray.serve.app import DecodeReplica, PrefillReplica, Router, ServeOptions, build_app
from kvray.serve.host import replica_engine_id

__all__ = ["DecodeReplica", "PrefillReplica", "Router", "ServeOptions", "build_app", "replica_engine_id"]
