"""The Ray Serve application over HTTP: concurrent requests equal colocated generation; a decode
replica killed under load fails its requests with a clear HTTP error and no hang, its engine
leaves the directory, Serve's replacement registers, and later requests succeed; decode scales
up and down in place (the other replicas keep running); a replica's host forwards
`ray`-transport writes (bytes and canaries checked) and its health check follows the agent and
its registration. The app fails closed as a public service: bodies past the cap answer 413 before
the router reads them whole, a full queue answers 503, failures behind the router answer only
documented type names and fixed messages (no tracebacks, paths, pids, addresses)."""

from __future__ import annotations

import asyncio
import logging
import re
import select
import socket
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import ray
import requests
from process_probes import wait_until

from kvray import errors
from kvray.config import Settings
from kvray.coordinator import get_or_create_coordinator
from kvray.errors import (
    BackpressureError,
    KvrayError,
    MetadataError,
    TransferTimeoutError,
    UnknownEngineError,
    WireDecodeError,
)
from kvray.host.forwarded import ForwardedDirectory
from kvray.memory import Backing, MemoryKind
from kvray.models.reference import MODEL_PRESETS, ReferenceModel, encode_text
from kvray.wire import Role, TransportKind, decode_engine_info
from kvray.workers import DecodeWorker, PrefillWorker

serve = pytest.importorskip("ray.serve", reason="the Serve app needs the serve extra")
kvray_serve = pytest.importorskip("kvray.serve")
from kvray.serve.app import (  # noqa: E402
    KV_TIMEOUT_MESSAGE,
    PUBLIC_MESSAGES,
    deployment_version,
    http_error,
    start_worker,
)

SETTINGS = Settings(
    heartbeat_s=0.5,
    lookup_timeout_s=5.0,
    transfer_timeout_s=15.0,
    notify_timeout_s=5.0,
    coordinator_name="kvray-coordinator-serve-tests",
)
OPTIONS = kvray_serve.ServeOptions(
    model="mixed",
    num_blocks=128,
    prefill_replicas=1,
    decode_replicas=2,
    replica_cpus=0.5,
    request_timeout_s=20.0,
    settings=SETTINGS,
)
MODEL = ReferenceModel(MODEL_PRESETS["mixed"])
#: The client's own bound: far above the app's deadline, so a hang fails the test, not a 504.
CLIENT_TIMEOUT_S = 90.0
#: The `type` of every failed answer: a kvray error class or a name `kvray.serve` documents.
PUBLIC_TYPES = set(errors.__all__) | {
    "BadRequest",
    "NotFound",
    "MethodNotAllowed",
    "PayloadTooLarge",
    "ReplicaDied",
    "BackPressureError",
    "DeploymentUnavailableError",
    "InternalError",
}
#: What no answer may carry: a traceback, a file path, a pid, an IP address, an actor id.
LEAKS = re.compile(r"Traceback|File \"|\.py\b|/[a-z_]+/|pid=|\b\d{1,3}(\.\d{1,3}){3}\b|[0-9a-f]{24,}|Actor")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def colocated(tokens: Sequence[int], max_tokens: int) -> list[int]:
    """Reference generation in this process: prefill and decode on one backing."""
    backing = Backing.allocate(MODEL.layout(OPTIONS.num_blocks), MemoryKind.CPU)
    try:
        blocks = list(range(MODEL.blocks_needed(len(tokens) + max_tokens)))
        return MODEL.generate(list(tokens), backing.views, blocks, max_tokens)
    finally:
        backing.close()


def _prompts(count: int, seed: int) -> list[tuple[dict[str, Any], list[int]]]:
    """(request body, prompt tokens): token-id and text prompts of 1 to 40 tokens."""
    rng = np.random.default_rng(seed)
    out: list[tuple[dict[str, Any], list[int]]] = []
    for index in range(count):
        max_tokens = int(rng.integers(1, 10))
        if index % 2:
            text = f"Request {index}: two layers of one geometry are two layers."[: int(rng.integers(1, 40))]
            out.append(({"text": text, "max_tokens": max_tokens}, encode_text(text)))
        else:
            tokens = [int(t) for t in rng.integers(0, 256, int(rng.integers(1, 41)))]
            out.append(({"prompt": tokens, "max_tokens": max_tokens}, tokens))
    return out


def _engines(role: Role) -> set[str]:
    coordinator = get_or_create_coordinator(SETTINGS)
    return {
        decode_engine_info(info).engine_id
        for info in ray.get(coordinator.engines.remote(role.value), timeout=30)
    }


def _decode_stats() -> list[dict[str, Any]]:
    """`stats()` of every decode replica (a new handle may not know the replicas yet: retry)."""
    handle = serve.get_deployment_handle("Decode", app_name="kvray")
    deadline = time.monotonic() + 60.0
    while True:
        try:
            return list(handle.broadcast("stats").results(timeout_s=30))
        except serve.exceptions.DeploymentUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _replica_actor(engine_id: str) -> Any:
    app, deployment, replica = engine_id.split("-")
    return ray.get_actor(f"SERVE_REPLICA::{app}#{deployment}#{replica}", namespace="serve")


@pytest.fixture(scope="module")
def app_url(local_ray: None) -> Iterator[str]:
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port, "request_timeout_s": CLIENT_TIMEOUT_S})
    serve.run(kvray_serve.build_app(OPTIONS), name="kvray", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def _post(url: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(f"{url}/generate", json=body, timeout=CLIENT_TIMEOUT_S)


def _check_public_error(status: int, body: bytes) -> dict[str, Any]:
    """A failed answer's JSON body: a documented type, a fixed message, nothing from inside."""
    error: dict[str, Any] = msgspec.json.decode(body)
    assert set(error) == {"error", "type", "request_id"}, error
    assert error["type"] in PUBLIC_TYPES, error
    if status >= 500:
        fixed = {*PUBLIC_MESSAGES.values(), KV_TIMEOUT_MESSAGE}
        assert error["error"] in fixed or error["type"] == "ReplicaDied", error
        assert not LEAKS.search(body.decode()), body
    return error


def _raw_request(url: str, head: str, path: str = "/generate") -> socket.socket:
    """A connection that has sent `POST path` with `head` (header lines) and no body yet."""
    host, port = url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)), timeout=CLIENT_TIMEOUT_S)
    connection.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{head}\r\n".encode())
    return connection


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _read_answer(connection: socket.socket) -> tuple[int, bytes]:
    """(status, body) of the HTTP answer on `connection` (Content-Length or chunked)."""
    reader = connection.makefile("rb")
    status = int(reader.readline().split()[1])
    headers: dict[str, str] = {}
    while (line := reader.readline().strip()) != b"":
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        return status, reader.read(int(headers["content-length"]))
    body = b""
    while (size := int(reader.readline().strip(), 16)) > 0:
        body += reader.read(size)
        reader.readline()
    return status, body


def _check_ok(response: requests.Response, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    assert reply["tokens"] == colocated(tokens, max_tokens), reply
    assert reply["prompt_tokens"] == len(tokens)
    assert reply["transport"] == TransportKind.SHM.value
    return reply


def test_concurrent_requests_equal_colocated_generation(app_url: str) -> None:
    decodes, prefills = _engines(Role.DECODE), _engines(Role.PREFILL)
    assert len(decodes) == OPTIONS.decode_replicas and len(prefills) == OPTIONS.prefill_replicas
    prompts = _prompts(16, seed=1)
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda item: _post(app_url, item[0]), prompts))
    for (body, tokens), response in zip(prompts, responses, strict=True):
        reply = _check_ok(response, tokens, body["max_tokens"])
        assert reply["decode_engine"] in decodes and reply["prefill_engine"] in prefills
    # Every block went back to its pool on both sides (no leak), on every replica.
    for stats in _decode_stats():
        assert stats["used_blocks"] == 0 and stats["requests"] == 0, stats


def _prefill_stats() -> list[dict[str, Any]]:
    handle = serve.get_deployment_handle("Prefill", app_name="kvray")
    return list(handle.broadcast("stats").results(timeout_s=30))


def _disconnect_after(url: str, body: dict[str, Any], seconds: float) -> None:
    """Send a whole request, then hang up after `seconds` without reading the answer (Serve's
    proxy then cancels the request)."""
    payload = msgspec.json.encode(body)
    head = f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
    connection = _raw_request(url, head)
    connection.sendall(payload)
    time.sleep(seconds)
    connection.close()


def test_cancelled_requests_never_change_another_requests_kv(app_url: str) -> None:
    """Under concurrent load, requests cancelled by their deadline (a decode call given a few
    milliseconds) and by their client hanging up (at random points of prefill, push and
    decode) free their blocks on both sides, and no late write of theirs reaches the requests
    that reuse those blocks: every request that completes equals colocated generation, token
    for token, and nothing is left held or quarantined."""
    decode = serve.get_deployment_handle("Decode", app_name="kvray")
    rng = np.random.default_rng(7)
    good = _prompts(24, seed=3)
    long_prompt = [int(t) for t in rng.integers(0, 256, 40)]

    def deadline_cancel(index: int) -> str:
        deadline_s = 0.002 + 0.004 * (index % 5)
        response = decode.generate.remote(f"cancel-deadline-{index}", long_prompt, 8, deadline_s)
        try:
            response.result(timeout_s=CLIENT_TIMEOUT_S)
            return "done"
        except Exception as error:  # the deadline: a kvray TransferTimeoutError (or the prefill's)
            return type(error).__name__

    def hang_up(index: int) -> str:
        _disconnect_after(app_url, {"prompt": long_prompt, "max_tokens": 8}, 0.002 * (index % 20))
        return "hung up"

    with ThreadPoolExecutor(12) as pool:
        cancelled = [pool.submit(deadline_cancel, i) for i in range(20)]
        cancelled += [pool.submit(hang_up, i) for i in range(40)]
        answers = list(pool.map(lambda item: _post(app_url, item[0]), good))
        outcomes = [future.result() for future in cancelled]
    for (body, tokens), response in zip(good, answers, strict=True):
        _check_ok(response, tokens, body["max_tokens"])
    assert outcomes.count("hung up") == 40
    assert any(outcome != "done" for outcome in outcomes[:20]), "no request met its deadline"

    def settled() -> bool:
        decodes, prefills = _decode_stats(), _prefill_stats()
        return all(s["used_blocks"] == 0 and s["quarantined_requests"] == 0 for s in decodes + prefills)

    wait_until(settled, "every block of every request back in its pool", seconds=30)
    # Whatever a late push still tried after its request ended was refused, never written.
    after = [_post(app_url, body) for body, _ in good[:6]]
    for (body, tokens), response in zip(good[:6], after, strict=True):
        _check_ok(response, tokens, body["max_tokens"])


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"prompt": [], "max_tokens": 3}, 400, "empty"),
        ({"prompt": [1, 256], "max_tokens": 3}, 400, r"\[0, 256\)"),
        ({"text": "a", "prompt": [1]}, 400, "not both"),
        ({"text": "a", "max_tokens": 0}, 400, "max_tokens"),
        ({"text": "a", "max_tokens": 2, "temperature": 1}, 400, "temperature"),
        ({"prompt": list(range(200)) * 5, "max_tokens": 100}, 400, "positions"),
        # The length is checked before any token is looked at.
        ({"prompt": [-1] * 5000, "max_tokens": 1}, 400, "5000 prompt tokens .* positions"),
        ({"text": "é" * 3000, "max_tokens": 1}, 400, "3000 prompt tokens .* positions"),
    ],
)
def test_bad_requests_are_refused_before_anything_is_reserved(
    app_url: str, body: dict[str, Any], status: int, message: str
) -> None:
    response = _post(app_url, body)
    assert response.status_code == status
    assert response.json()["type"] == "BadRequest"
    assert re.search(message, response.json()["error"]), response.json()


def test_other_paths_and_methods_and_malformed_json(app_url: str) -> None:
    assert requests.get(f"{app_url}/generate", timeout=CLIENT_TIMEOUT_S).status_code == 405
    assert requests.post(f"{app_url}/other", json={}, timeout=CLIENT_TIMEOUT_S).status_code == 404
    malformed = requests.post(f"{app_url}/generate", data=b"{", timeout=CLIENT_TIMEOUT_S)
    assert malformed.status_code == 400 and "invalid request body" in malformed.json()["error"]


def test_bodies_over_the_cap_answer_413_before_the_router_reads_them(app_url: str) -> None:
    """Declared too long: refused on the header alone, no body byte sent. Chunked (no length
    declared): refused once the cap is passed, while the client still holds the rest of the
    body; a router that read the whole body first would never answer."""
    cap = OPTIONS.max_body_bytes
    declared = _raw_request(app_url, f"Content-Type: application/json\r\nContent-Length: {cap + 1}\r\n")
    chunked = _raw_request(app_url, "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n")
    try:
        chunked.sendall(_chunk(b'{"text": "' + b"a" * cap))
        for connection in (declared, chunked):
            status, body = _read_answer(connection)
            assert status == 413, body
            error = msgspec.json.decode(body)
            assert error["type"] == "PayloadTooLarge" and str(cap) in error["error"], error
    finally:
        declared.close()
        chunked.close()
    # A body within the cap is still served.
    _check_ok(_post(app_url, {"prompt": [1, 2, 3], "max_tokens": 2}), [1, 2, 3], 2)


def test_full_queues_answer_503_and_failures_answer_public_types_only(app_url: str) -> None:
    """A second, small app with a tiny deadline: a request passes it behind the router, a 504
    whose type is the kvray class (not Ray's wrapper) and whose message is fixed, nothing from
    inside. Its router works on one request and queues one more: three requests whose bodies
    the clients hold back fill both places, so one of them is refused at once with 503."""
    tight = kvray_serve.ServeOptions(
        model="mixed",
        num_blocks=16,
        prefill_replicas=1,
        decode_replicas=1,
        replica_cpus=0,
        request_timeout_s=0.001,
        max_ongoing_requests=1,
        max_queued_requests=1,
        settings=SETTINGS,
    )
    serve.run(kvray_serve.build_app(tight), name="kvray-tight", route_prefix="/tight")
    held: list[socket.socket] = []
    try:
        late = requests.post(
            f"{app_url}/tight/generate", json={"prompt": [1, 2, 3]}, timeout=CLIENT_TIMEOUT_S
        )
        assert late.status_code == 504, late.text
        assert _check_public_error(late.status_code, late.content)["type"] == TransferTimeoutError.__name__

        for _ in range(3):
            held.append(_raw_request(app_url, "Transfer-Encoding: chunked\r\n", "/tight/generate"))
            held[-1].sendall(_chunk(b'{"prompt": [1, 2, 3],'))
        ready, _, _ = select.select(held, [], [], CLIENT_TIMEOUT_S)
        assert ready, "no request was refused while the router and its queue were full"
        refused = ready[0]
        status, body = _read_answer(refused)
        assert status == 503, body
    finally:
        for connection in held:
            connection.close()
        serve.delete("kvray-tight")


def test_killed_decode_replica_fails_cleanly_and_is_replaced(app_url: str) -> None:
    before = _engines(Role.DECODE)
    # One long request (many new tokens) keeps a decode replica busy; kill that replica while
    # it holds the request, with other requests in flight.
    long_tokens = [token % 256 for token in range(200)]
    long_body = {"prompt": long_tokens, "max_tokens": OPTIONS.max_tokens}
    prompts = _prompts(12, seed=2)
    with ThreadPoolExecutor(8) as pool:
        long_future = pool.submit(_post, app_url, long_body)
        busy: list[str] = []

        def holds_a_request() -> bool:
            busy[:] = [stats["engine_id"] for stats in _decode_stats() if stats["requests"] > 0]
            return bool(busy)

        wait_until(holds_a_request, "a decode replica holds the long request", seconds=60.0)
        futures = [pool.submit(_post, app_url, body) for body, _ in prompts]
        victim = busy[0]
        ray.kill(_replica_actor(victim), no_restart=True)
        outcomes = [(body, tokens, f.result()) for (body, tokens), f in zip(prompts, futures, strict=True)]
        long_response = long_future.result()
        outcomes.append((long_body, long_tokens, long_response))

    failed = 0
    for body, tokens, response in outcomes:
        if response.status_code == 200:
            _check_ok(response, tokens, body["max_tokens"])
            continue
        failed += 1
        error = _check_public_error(response.status_code, response.content)
        assert response.status_code in (502, 503, 504), error
        assert error["request_id"], error
    # The killed replica held the long request: it failed, as a clear error, not a hang.
    assert failed >= 1
    assert long_response.status_code == 503 and long_response.json()["type"] == "ReplicaDied"

    # Its engine leaves the directory (its host died with it); Serve's replacement registers.
    wait_until(lambda: victim not in _engines(Role.DECODE), "the killed engine is dropped", seconds=60.0)
    wait_until(
        lambda: len(_engines(Role.DECODE) - before) == 1 and len(_engines(Role.DECODE)) == 2,
        "a replacement decode engine registers",
        seconds=120.0,
    )
    assert victim not in _engines(Role.DECODE)

    # Later requests succeed again, and none is handed to the dead engine.
    later = _prompts(6, seed=3)
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda item: _post(app_url, item[0]), later))
    for (body, tokens), response in zip(later, responses, strict=True):
        assert _check_ok(response, tokens, body["max_tokens"])["decode_engine"] != victim


async def test_replica_host_forwards_ray_writes_and_health_follows_the_agent(
    local_ray: None, canary_mask: Any
) -> None:
    """A decode engine as a replica runs it (here in the test's process): a prefill worker pushes
    over the `ray` transport, so the write and its checks pass through the engine's host actor."""
    # No heartbeat during the test: a lost registration stays lost until looked at.
    settings = msgspec.structs.replace(SETTINGS, transport="ray", heartbeat_s=300.0)
    options = kvray_serve.ServeOptions(model="mixed", num_blocks=16, settings=settings)
    decode, engine = await start_worker(DecodeWorker, "serve-host-d0", options)
    prefill = PrefillWorker(
        "serve-host-p0",
        decode.kvray_agent.layout,
        settings,
        coordinator=ForwardedDirectory(settings, None),
    )
    coordinator = get_or_create_coordinator(SETTINGS)
    try:
        await engine.check_health()
        await prefill.start()
        await decode.fill_region(seed=5)
        before = await decode.snapshot()
        source = await prefill.allocate("req-1", 3)
        await prefill.fill_random("req-1", 9)
        expected = await prefill.read_blocks(source)
        reservation = await decode.reserve("req-1", 3)
        blocks = list(reservation.blocks)
        pushed = await prefill.push(reservation)
        assert pushed.transport is TransportKind.RAY
        await decode.wait("req-1", 10.0)
        landed = await decode.read_blocks(blocks)
        assert all(np.array_equal(landed[layer], expected[layer]) for layer in expected)
        after = await decode.snapshot()
        for (offset, old), (_, new) in zip(before, after, strict=True):
            mask = canary_mask(decode.kvray_agent.info, offset, old.size, [(blocks, None)])
            assert np.array_equal(old[~mask], new[~mask])  # canaries: nothing else changed
            assert not np.array_equal(old[mask], new[mask])
        await decode.release("req-1")
        assert decode.pool.used_count == 0 and prefill.pool.used_count == 0

        # A malformed notice forwarded through the host fails its sender, as it would directly.
        with pytest.raises(WireDecodeError):
            await engine.host.kvray_notify.remote(b"not a message")

        # Registration lost (e.g. the coordinator restarted and the next heartbeat is not due yet).
        # Only the registrant may deregister: with the agent's own secret.
        agent = decode.kvray_agent
        await coordinator.deregister.remote("serve-host-d0", agent.incarnation, agent.registrant_secret)
        with pytest.raises(MetadataError, match="not registered"):
            await engine.check_health()
    finally:
        await engine.close()
        await prefill.close()
    with pytest.raises(KvrayError, match="not running"):
        await engine.check_health()
    with pytest.raises(UnknownEngineError):
        await coordinator.lookup.remote("serve-host-d0", 0.1)


def _directory(role: Role) -> dict[str, int]:
    """engine id -> incarnation of every engine of `role` in the coordinator's directory."""
    coordinator = get_or_create_coordinator(SETTINGS)
    infos = [decode_engine_info(info) for info in ray.get(coordinator.engines.remote(role.value), timeout=30)]
    return {info.engine_id: info.incarnation for info in infos}


def _dropped_dead() -> int:
    coordinator = get_or_create_coordinator(SETTINGS)
    return int(ray.get(coordinator.stats.remote(), timeout=30)["dropped_dead"])


def _redeploy(decode_replicas: int) -> None:
    """`serve.run` of the module's app again, with only the decode replica count changed."""
    options = msgspec.structs.replace(OPTIONS, decode_replicas=decode_replicas)
    assert deployment_version(options) == deployment_version(OPTIONS)
    other = msgspec.structs.replace(OPTIONS, num_blocks=OPTIONS.num_blocks + 1)
    assert deployment_version(other) != deployment_version(OPTIONS)
    serve.run(kvray_serve.build_app(options), name="kvray", route_prefix="/")


def test_decode_scales_up_and_down_in_place(app_url: str) -> None:
    """Redeploying with one decode replica more adds one engine and keeps the others (same
    incarnations: not restarted); the new one serves requests. Back to the old count, one engine
    deregisters (not dropped as dead), the others stay, and no request names it again."""
    dead_before = _dropped_dead()
    before = _directory(Role.DECODE)
    prefills = _directory(Role.PREFILL)
    count = len(before)
    assert count == OPTIONS.decode_replicas

    _redeploy(count + 1)
    wait_until(
        lambda: len(_directory(Role.DECODE)) == count + 1, "a new decode engine registers", seconds=60.0
    )
    scaled_up = _directory(Role.DECODE)
    assert {engine: scaled_up.get(engine) for engine in before} == before  # not restarted
    (added,) = set(scaled_up) - set(before)
    assert _directory(Role.PREFILL) == prefills

    # Serve's router picks replicas at random among the least loaded: send rounds of requests,
    # each answer checked, until the new engine has served some (bounded rounds, not time).
    served: set[str] = set()
    with ThreadPoolExecutor(6) as pool:
        for round_index in range(10):
            prompts = _prompts(6, seed=10 + round_index)
            responses = list(pool.map(lambda item: _post(app_url, item[0]), prompts))
            for (body, tokens), response in zip(prompts, responses, strict=True):
                served.add(_check_ok(response, tokens, body["max_tokens"])["decode_engine"])
            if added in served:
                break
    assert added in served, served
    assert served <= set(scaled_up)

    _redeploy(count)
    wait_until(lambda: len(_directory(Role.DECODE)) == count, "one decode engine deregisters", seconds=60.0)
    scaled_down = _directory(Role.DECODE)
    (removed,) = set(scaled_up) - set(scaled_down)
    assert scaled_down == {engine: scaled_up[engine] for engine in scaled_up if engine != removed}
    assert _dropped_dead() == dead_before  # it closed and deregistered, it did not die
    assert _directory(Role.PREFILL) == prefills

    later = _prompts(8, seed=30)
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda item: _post(app_url, item[0]), later))
    for (body, tokens), response in zip(later, responses, strict=True):
        assert _check_ok(response, tokens, body["max_tokens"])["decode_engine"] in scaled_down


def test_deleting_the_app_deregisters_every_engine(app_url: str) -> None:
    """Scaling to zero: Serve stops each replica gracefully (`__del__`), which deregisters its
    engine; none is dropped as dead. (Runs last: it removes the module's app.)"""
    coordinator = get_or_create_coordinator(SETTINGS)
    dead_before = ray.get(coordinator.stats.remote(), timeout=30)["dropped_dead"]
    assert _engines(Role.DECODE) and _engines(Role.PREFILL)
    serve.delete("kvray")
    assert not _engines(Role.DECODE) and not _engines(Role.PREFILL)
    assert ray.get(coordinator.stats.remote(), timeout=30)["dropped_dead"] == dead_before


@pytest.mark.parametrize(
    ("cause", "status", "kind", "message"),
    [
        (
            TransferTimeoutError("the prefill of 'serve-1' passed its deadline", timeout_s=1.0),
            504,
            "TransferTimeoutError",
            KV_TIMEOUT_MESSAGE,
        ),
        (BackpressureError("8 pushes queued", queued=8), 503, "BackpressureError", None),
        (MetadataError("engine 'kvray-Decode-x' at /dev/shm/kvray-1 is gone"), 502, "MetadataError", None),
        (ZeroDivisionError("division by zero"), 500, "InternalError", None),
    ],
)
def test_failures_behind_the_router_answer_the_documented_type_and_a_fixed_message(
    cause: Exception, status: int, kind: str, message: str | None
) -> None:
    """No Ray needed: a failure as Ray re-raises it from a replica (a class named after Ray's
    wrapper and the cause, whose text is the remote traceback with pid, address and paths)."""
    remote = ray.exceptions.RayTaskError(
        "generate",
        'Traceback (most recent call last):\n  File "/srv/kvray/serve.py", line 1, in generate\n',
        cause,
        pid=4242,
        ip="10.1.2.3",
    ).as_instanceof_cause()
    assert "RayTaskError" in type(remote).__name__ and "/srv/kvray" in str(remote)
    answer = http_error(remote)
    assert answer == (status, kind, message or PUBLIC_MESSAGES[status])
    body = msgspec.json.encode({"error": answer[2], "type": answer[1], "request_id": "serve-1"})
    _check_public_error(status, body)


class _Response:
    """A stand-in `DeploymentResponse`: raises `error` when awaited, or never answers."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error
        self.cancelled = False

    def __await__(self) -> Any:
        if self.error is not None:
            raise self.error
        yield from asyncio.get_running_loop().create_future().__await__()

    def cancel(self) -> None:
        self.cancelled = True


class _Decode:
    """A stand-in handle to the decode deployment whose every `generate` call answers `response`."""

    def __init__(self, response: _Response) -> None:
        self.generate = self
        self.response = response

    def remote(self, *args: Any) -> _Response:
        return self.response


async def _route(response: _Response, options: Any) -> tuple[int, dict[str, Any], str]:
    """(status, body, Serve log line) of the router's answer to one good request when the decode
    replica answers `response`."""
    from starlette.requests import Request

    body = msgspec.json.encode({"prompt": [1, 2, 3], "max_tokens": 2})
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/generate",
        "headers": [(b"content-length", str(len(body)).encode())],
    }
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        sent, was_sent = True, sent
        return {"type": "http.disconnect"} if was_sent else {"type": "http.request", "body": body}

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("ray.serve")
    logger.addHandler(handler)
    try:
        answer = await kvray_serve.Router(options, _Decode(response))(Request(scope, receive))
    finally:
        logger.removeHandler(handler)
    (record,) = [record for record in records if record.levelno >= logging.WARNING]
    return answer.status_code, msgspec.json.decode(bytes(answer.body)), record.getMessage()


async def test_the_router_tells_its_own_deadline_from_a_timeout_a_replica_reported() -> None:
    """No Ray needed: the router over a stand-in decode handle. A replica that reports a
    TransferTimeoutError (its KV did not arrive within its deadline) and a replica that does not
    answer within the router's own deadline both answer 504 TransferTimeoutError, each with its
    own fixed message, and the Serve log says whose deadline it was."""
    settings = msgspec.structs.replace(SETTINGS, notify_timeout_s=0.05)
    options = msgspec.structs.replace(OPTIONS, request_timeout_s=0.05, settings=settings)

    message = "wait_for_kv of 'serve-1' passed its 0.05 s deadline"
    # As Ray re-raises it: the remote traceback ends with the error's class and message.
    remote = ray.exceptions.RayTaskError(
        "generate",
        f"Traceback (most recent call last):\nkvray.errors.TransferTimeoutError: {message}",
        TransferTimeoutError(message, timeout_s=0.05),
        pid=4242,
        ip="10.1.2.3",
    ).as_instanceof_cause()
    replica = _Response(remote)
    status, body, log = await _route(replica, options)
    assert (status, body["type"]) == (504, "TransferTimeoutError"), body
    assert body["error"] == KV_TIMEOUT_MESSAGE
    _check_public_error(status, msgspec.json.encode(body))
    assert "decode replica reported a TransferTimeoutError" in log, log
    assert "did not arrive within the replica's deadline" in log and "router's own deadline" not in log, log
    assert "wait_for_kv of 'serve-1'" in log, log

    silent = _Response(None)
    status, body, log = await _route(silent, options)
    assert (status, body["type"]) == (504, "TransferTimeoutError"), body
    assert body["error"] == PUBLIC_MESSAGES[504]
    _check_public_error(status, msgspec.json.encode(body))
    assert "no answer from the decode replica within the router's own deadline" in log, log
    assert "replica reported" not in log and "passed its 0.1 s deadline" in log, log
    assert silent.cancelled and not replica.cancelled


def test_the_example_config_documents_every_option() -> None:
    """examples/serve_config.yaml gives every `ServeOptions` field (so each is documented there),
    its args build valid options, and it sets the proxy's HTTP request timeout above the app's."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    path = Path(__file__).resolve().parents[2] / "examples" / "serve_config.yaml"
    config = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert set(app["args"]) == set(kvray_serve.ServeOptions.__struct_fields__)
    options = kvray_serve.ServeOptions.from_args(app["args"])
    assert config["http_options"]["request_timeout_s"] > options.request_timeout_s
