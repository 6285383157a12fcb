"""Settings: one struct passed in explicitly; the only module that reads KVRAY_* variables."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import msgspec

from kvray.errors import ConfigError

PAGE_SIZE = 4096
GPU_PAGE_SIZE = 2 * 1024 * 1024


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Every knob kvray has. Build one, or read one from the environment with `from_env`."""

    #: Alignment unit of CPU and shared-memory regions (start and length), in bytes.
    alignment: int = PAGE_SIZE
    #: Alignment unit of GPU regions.
    gpu_alignment: int = GPU_PAGE_SIZE
    #: Folder of shared-memory backing files.
    shm_dir: str = "/dev/shm"
    #: Ray namespace and name of the coordinator actor.
    namespace: str = "kvray"
    coordinator_name: str = "kvray-coordinator"
    #: Seconds to wait for a peer engine to register before a lookup fails.
    lookup_timeout_s: float = 30.0
    #: Seconds a single transfer (plan, write, completion) may take.
    transfer_timeout_s: float = 60.0
    #: Transfers one agent runs at once; more wait (with their deadline) for a slot.
    max_concurrent_transfers: int = 8
    #: Transfers one agent accepts queued beyond the running ones before refusing new pushes.
    max_queued_transfers: int = 256
    #: Transport to use: "auto", "shm", "ray", "cuda_ipc" or "verbs".
    transport: str = "auto"
    #: Seconds between an agent's heartbeats to the coordinator (re-registers after a restart).
    heartbeat_s: float = 2.0
    #: Seconds a control message to a peer (completion, failure notice) may take.
    notify_timeout_s: float = 10.0
    #: Threads one CPU copy (shm write, ray gather and scatter) uses; 0 picks every core (1 to
    #: 4). Fewer leaves cores to a model computing in the same process or on the same node.
    copy_threads: int = 0
    #: RDMA device for the `verbs` transport: a name (e.g. "mlx5_0"), or "auto" for the device
    #: with an active port nearest this process (same NUMA node), else the first active one.
    verbs_device: str = "auto"
    #: Port of that device (ports count from 1).
    verbs_port: int = 1
    #: GID table index to address the port by; -1 picks one (IPv4-mapped RoCE v2 first).
    verbs_gid_index: int = -1
    #: Every Nth RDMA WRITE asks for a completion (the last of a transfer always does).
    verbs_signal_every: int = 16
    #: Work requests one queue pair may have posted and not yet completed.
    verbs_queue_depth: int = 256

    def __post_init__(self) -> None:
        for name in ("alignment", "gpu_alignment"):
            value = getattr(self, name)
            if value <= 0 or value & (value - 1):
                raise ConfigError(
                    f"{name} must be a positive power of two, got {value}", setting=name, value=value
                )
        if self.transport not in ("auto", "shm", "ray", "cuda_ipc", "verbs"):
            raise ConfigError(
                f"transport must be auto, shm, ray, cuda_ipc or verbs, got {self.transport!r}",
                setting="transport",
                value=self.transport,
            )
        for name in ("lookup_timeout_s", "transfer_timeout_s", "heartbeat_s", "notify_timeout_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(
                    f"{name} must be a positive, finite number of seconds (nothing waits forever), "
                    f"got {value}",
                    setting=name,
                    value=value,
                )
        for name in (
            "max_concurrent_transfers",
            "max_queued_transfers",
            "verbs_port",
            "verbs_signal_every",
            "verbs_queue_depth",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive", setting=name, value=getattr(self, name))
        if self.copy_threads < 0:
            raise ConfigError(
                f"copy_threads must be 0 (pick) or a number of threads, got {self.copy_threads}",
                setting="copy_threads",
                value=self.copy_threads,
            )
        if self.verbs_gid_index < -1:
            raise ConfigError(
                f"verbs_gid_index must be a GID table index, or -1 to pick one, got {self.verbs_gid_index}",
                setting="verbs_gid_index",
                value=self.verbs_gid_index,
            )
        if not self.verbs_device:
            raise ConfigError(
                'verbs_device must name an RDMA device (e.g. "mlx5_0") or be "auto"',
                setting="verbs_device",
                value=self.verbs_device,
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults, then KVRAY_<FIELD> variables (e.g. KVRAY_ALIGNMENT=8192), then `overrides`."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in msgspec.structs.fields(cls):
            raw = environ.get(f"KVRAY_{field.name.upper()}")
            if raw is None:
                continue
            try:
                values[field.name] = msgspec.convert(raw, field.type, strict=False)
            except msgspec.ValidationError as error:
                raise ConfigError(
                    f"KVRAY_{field.name.upper()}={raw!r} is not a valid {field.name}: {error}",
                    setting=field.name,
                    value=raw,
                ) from None
        values.update(overrides)
        try:
            return msgspec.convert(values, cls)
        except msgspec.ValidationError as error:
            cause = error.__cause__
            if isinstance(cause, ConfigError):
                setting = cause.facts.get("setting")
                variable = f"KVRAY_{str(setting).upper()}"
                source = f"{variable}: " if setting not in overrides and variable in environ else ""
                raise ConfigError(f"{source}{cause.message}", **cause.facts) from None
            raise ConfigError(f"invalid settings: {error}") from None
