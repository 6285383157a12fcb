"""vLLM engines for the test session: the P/D, model-family and TP modules take their engines from
one pool on the session's two-node Ray, so an engine that several modules use starts once.

An engine a module asks for `shared` stays up for the modules after it and is reused by any that
asks for the same one (same model, connector settings but its digest log, node and engine
arguments); the module's digest-log path then names the running engine's log (a symbolic link),
so a module reads its logs where it always did. Every other engine is the module's own and is
killed when the module ends: one a test kills or poisons (a seed-bug engine) is never shared."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

#: Where a connector's digest log is named in `transfer_config(...)`'s result.
EXTRA = "kv_connector_extra_config"
DIGEST_LOG = "digest_log"


def _digest_log(transfer: Mapping[str, Any] | None) -> Path | None:
    if transfer is None:
        return None
    path = transfer.get(EXTRA, {}).get(DIGEST_LOG)
    return None if path is None else Path(path)


def _key(model: str, transfer: Mapping[str, Any] | None, node: str, engine_kwargs: Mapping[str, Any]) -> str:
    """What makes two engines the same engine: everything they were started with but the file
    the digest log goes to."""
    settings = None
    if transfer is not None:
        extra = {name: value for name, value in transfer.get(EXTRA, {}).items() if name != DIGEST_LOG}
        settings = {**transfer, EXTRA: extra}
    return json.dumps([model, settings, node, engine_kwargs], sort_keys=True, default=str)


@dataclass
class SharedEngine:
    actor: Any
    digest_log: Path | None


@dataclass
class EnginePool:
    """The session's engines that modules share (`shared=True`), by `_key`."""

    shared: dict[str, SharedEngine] = field(default_factory=dict)

    def close(self) -> None:
        for engine in self.shared.values():
            ray.kill(engine.actor)
        self.shared.clear()


@dataclass
class ModuleEngines:
    """One module's view of the pool: `start` an engine (a Ray actor running
    `kvray.integrations.vllm.pd.Engine`, pinned to `node`), its own or shared."""

    pool: EnginePool
    own: list[Any] = field(default_factory=list)

    def start(
        self,
        model: str,
        transfer: Mapping[str, Any] | None,
        *,
        node: str = "node_a",
        shared: bool = False,
        **engine_kwargs: Any,
    ) -> Any:
        """The engine's actor, starting (wait on `processes` for it to be up)."""
        from kvray.integrations.vllm.pd import Engine

        key = _key(model, transfer, node, engine_kwargs)
        wanted_log = _digest_log(transfer)
        if shared and key in self.pool.shared:
            running = self.pool.shared[key]
            if wanted_log is not None and running.digest_log is not None:
                wanted_log.parent.mkdir(parents=True, exist_ok=True)
                running.digest_log.touch()
                wanted_log.symlink_to(running.digest_log)
            return running.actor
        actor = (
            ray.remote(num_cpus=0)(Engine)
            .options(resources={node: 1})
            .remote(model, transfer, **engine_kwargs)
        )
        if shared:
            self.pool.shared[key] = SharedEngine(actor, wanted_log)
        else:
            self.own.append(actor)
        return actor

    def stop(self, *actors: Any) -> None:
        """Stop these engines if they are the module's own (a shared one stays up)."""
        for actor in actors:
            if actor in self.own:
                self.own.remove(actor)
                ray.kill(actor)

    def close(self) -> None:
        self.stop(*list(self.own))


def mla_decode_engine(engines: ModuleEngines, digest_log: Path) -> Any:
    """The engine two modules share: a TP-1 decode engine of `kvray model tiny-deepseek` on
    `node_b` (`test_vllm_models_pd.py`'s decode engine for the MLA model, and
    `test_vllm_tp.py`'s TP-1 MLA engine)."""
    from handoff_logs import digest_logged

    from kvray.integrations.vllm.model import MODELS, TINY_DEEPSEEK, tiny_model

    extra = {
        "transfer_timeout_s": 30.0,
        "notify_timeout_s": 5.0,
        "lease_s": 120.0,
        "digest_every": 1,
        "digest_log": str(digest_log),
    }
    return engines.start(
        str(tiny_model(TINY_DEEPSEEK)),
        digest_logged(extra),
        node="node_b",
        shared=True,
        max_model_len=1024,
        engine_options=dict(MODELS[TINY_DEEPSEEK.name].engine_options),
    )
