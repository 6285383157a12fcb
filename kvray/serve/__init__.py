"""kvray on Ray Serve: the library host any engine embeds in its replicas (`host`), and the
reference application over the reference model (`app`). Needs the `serve` extra."""

from kvray.serve.app import (
    KV_TIMEOUT_MESSAGE,
    PUBLIC_MESSAGES,
    DecodeReplica,
    GenerateReply,
    GenerateRequest,
    PrefillReplica,
    Router,
    ServeOptions,
    build_app,
    deployment_version,
    http_error,
    prompt_tokens,
    read_body,
    start_worker,
    tokenize,
)
from kvray.serve.host import HostCall, ReplicaDirectory, ReplicaEngine, ReplicaHost, replica_engine_id

__all__ = [
    "KV_TIMEOUT_MESSAGE",
    "PUBLIC_MESSAGES",
    "DecodeReplica",
    "GenerateReply",
    "GenerateRequest",
    "HostCall",
    "PrefillReplica",
    "ReplicaDirectory",
    "ReplicaEngine",
    "ReplicaHost",
    "Router",
    "ServeOptions",
    "build_app",
    "deployment_version",
    "http_error",
    "prompt_tokens",
    "read_body",
    "replica_engine_id",
    "start_worker",
    "tokenize",
]
