"""The vLLM connector's digest logs in the vLLM tests: engines that write them (`digest_logged`:
`kvray.bench.handoff_log.DigestLogConnector`, whose `digest_log` gets one JSON line per hand-off
event on one engine, written by `DigestLog`), and reading them."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvray.agent.handoff import HandoffEvent
from kvray.bench.handoff_log import DIGEST_LOG_CONNECTOR
from kvray.integrations.vllm.pd import transfer_config

#: What refuses a request the seed bug wrote, at the defaults: its placement digest, or, for the
#: one request in a hundred whose checksums the defaults sample (checked first), those checksums.
SEED_BUG_REFUSALS = ("placement digest", "did not land as it was sent")


def digest_logged(extra: Mapping[str, Any], **options: Any) -> dict[str, Any]:
    """`pd.transfer_config(extra, **options)` of an engine with the digest-logging connector
    (`digest_log` and `digest_every` among `extra`)."""
    return transfer_config(extra, connector=DIGEST_LOG_CONNECTOR, **options)


def digests(path: Path) -> dict[tuple[str, str], dict[str, str]]:
    """(side, prefill request id) -> per-layer digest, from a connector's digest log."""
    found: dict[tuple[str, str], dict[str, str]] = {}
    for record in records(path):
        if "layers" in record:
            found[(record["side"], record["prefill_request"])] = record["layers"]
    return found


def head_digests(path: Path, side: str) -> dict[str, dict[str, str]]:
    """(prefill request id) -> per layer and KV head digest of one side of a digest log, every
    tensor-parallel rank's records merged (a prefill rank pushing to two decode ranks logs its
    heads twice: alike, or this fails)."""
    merged: dict[str, dict[str, str]] = {}
    for record in records(path):
        if record["side"] == side:
            heads = merged.setdefault(record["prefill_request"], {})
            for head, digest in record["heads"].items():
                assert heads.setdefault(head, digest) == digest, (record["prefill_request"], head)
    return merged


def failures(*paths: Path) -> list[str]:
    """Why hand-offs failed, as the connectors logged it (for assertion messages)."""
    logged = [record for path in paths for record in records(path)]
    return [f"{r['side']} {r['request']}: {r['error']}" for r in logged if "error" in r]


def records(path: Path) -> list[dict[str, Any]]:
    """Every record of a digest log (none if it does not exist yet)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def by_request(path: Path, side: str) -> dict[str, dict[str, Any]]:
    """The records of one side ("sent", "received") of a digest log, by prefill request id."""
    return {record["prefill_request"]: record for record in records(path) if record["side"] == side}


def asked(log: Path, timeout_s: float = 60.0) -> Callable[[list[str]], None]:
    """For `decode_first`: wait until the prefill engine (digest log `log`) holds a push
    request for every hand-off, so that its forward finds them all."""

    def wait(handoffs: list[str]) -> None:
        deadline = time.monotonic() + timeout_s
        asked = HandoffEvent.ASKED.value
        while not set(handoffs) <= {r["request"] for r in records(log) if r["side"] == asked}:
            assert time.monotonic() < deadline, "the decode engine did not ask for every hand-off"
            time.sleep(0.05)

    return wait
