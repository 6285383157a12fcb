"""Settings: one struct passed in explicitly; the only module that reads KVRAY_* variables."""

from __future__ import annotations

import ipaddress
import math
import numbers
import operator
import os
from collections.abc import Mapping
from typing import Any

import msgspec

from kvray.errors import ConfigError

PAGE_SIZE = 4096
GPU_PAGE_SIZE = 2 * 1024 * 1024
#: The largest `max_timeout_s` a deployment may set: one day.
TIMEOUT_CEILING_S = 86400.0

_TIMEOUT_SETTINGS = ("lookup_timeout_s", "transfer_timeout_s", "heartbeat_s", "notify_timeout_s")


def check_alignment(value: object, name: str = "alignment") -> int:
    """An alignment unit in bytes: an integer power of two of at least `PAGE_SIZE`, else
    `ConfigError` naming `name`. Smaller units would let a region start or end mid-page, which
    no transport can register (and a page is the unit the OS maps and protects)."""
    try:
        alignment = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        alignment = None
    if isinstance(value, bool) or alignment is None or alignment < PAGE_SIZE or alignment & (alignment - 1):
        raise ConfigError(
            f"{name} must be a power of two of at least {PAGE_SIZE} bytes (the page size), got {value!r}",
            setting=name,
            value=value,
        )
    return alignment


def _finite_seconds(value: object, name: str, *, allow_zero: bool = False) -> float:
    """`value` as seconds if it is a real number, finite and positive (or zero when
    `allow_zero`), else `ConfigError` naming `name`."""
    if type(value) is float or type(value) is int:  # the usual case, without the ABC check below
        seconds = float(value)
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number of seconds, got {value!r}", setting=name, value=value)
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        wanted = "zero or more" if allow_zero else "more than zero"
        raise ConfigError(
            f"{name} must be a finite number of seconds, {wanted} (nothing waits forever), got {value!r}",
            setting=name,
            value=value,
        )
    return seconds


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
    #: Upper bound, in seconds, of every wait: a timeout a caller passes (push, wait_for_kv,
    #: lookups, workers, Serve requests) is clamped to it, and every *_timeout_s setting must be
    #: within it. At most `TIMEOUT_CEILING_S`.
    max_timeout_s: float = 300.0
    #: Peer engines one agent keeps (their published info, shared-memory mappings, CUDA IPC
    #: handles, RDMA connections, offset tables); the least recently used beyond this is
    #: forgotten and looked up again when next needed.
    max_cached_peers: int = 256
    #: Bytes of peers' shared memory one writer keeps mapped (`shm`); past it the least recently
    #: used peers are unmapped first (and mapped again when next written to).
    max_mapped_bytes: int = 1 << 40
    #: Requests one decode agent may expect at once (the slots of its claim board).
    max_expected_requests: int = 4096
    #: Take notices from writers on other nodes over an authenticated TCP connection
    #: (`kvray.notice.tcp`); off, they come through a Ray call on the engine's actor each.
    notice_tcp: bool = True
    #: Address a decode engine listens on for those notices: an IP address of this node;
    #: empty picks the node's address as Ray knows it (no listener outside Ray).
    notice_host: str = ""
    #: Port of that listener; 0 picks a free one.
    notice_port: int = 0
    #: Ports from `notice_port` on that the listener may take, the first free one (several
    #: decode engines on one node each need one): a range a firewall can allow.
    notice_ports: int = 1
    #: Check every request's KV before it may decode (`kvray.content`): the copy that moves the
    #: bytes hashes them as it goes (shm, loopback, ray from host memory, the cuda_ipc kernel),
    #: or, where it cannot (an RDMA NIC's, verbs; GPU KV staged over ray), the decode side
    #: hashes what landed after the last write; against a digest the writer takes from its
    #: own blocks.
    #: Placement is checked on every transfer regardless (`kvray.placement`). A decode engine
    #: with it on asks its writers for the check (`Reservation.integrity`); off on both sides,
    #: only placement and the sampled checksums are.
    integrity: bool = True
    #: Also check every request that `integrity` cannot (GPU KV where Triton is missing, so no
    #: kernel of kvray's hashes it) by hashing every layer on both sides
    #: (`integrity_sample_rate` 1.0 for them): costly on a GPU (~1.6 ms per 64 MiB on each
    #: side, more than the copy). A decode engine with it on refuses KV that comes with no
    #: check at all.
    integrity_unhashed: bool = False
    #: Share of requests whose KV is also checked the slow way, the backstop (`kvray.integrity`:
    #: the writer hashes each layer's bytes, the decode side hashes them again as landed; 1.0:
    #: every request, 0.0: none). A request is picked by its id (a hash that does not tie
    #: related ids together), so every layer and every TP part of it is picked alike. Every
    #: request's KV is checked anyway while `integrity` is on; this adds a second, independent
    #: check of some, at the cost of reading every byte twice more.
    integrity_sample_rate: float = 0.01
    #: Routine hand-offs between engines of one deployment on one node through the prefill
    #: engine's native lane (`kvray.agent.lane`: no Python on the prefill side, none of the
    #: agent's event loop on the decode side); both engines need it on.
    native_lane: bool = True

    def __post_init__(self) -> None:
        for name in ("alignment", "gpu_alignment"):
            check_alignment(getattr(self, name), name)
        if self.transport not in ("auto", "shm", "ray", "cuda_ipc", "verbs"):
            raise ConfigError(
                f"transport must be auto, shm, ray, cuda_ipc or verbs, got {self.transport!r}",
                setting="transport",
                value=self.transport,
            )
        maximum = _finite_seconds(self.max_timeout_s, "max_timeout_s")
        if maximum > TIMEOUT_CEILING_S:
            raise ConfigError(
                f"max_timeout_s must be at most {TIMEOUT_CEILING_S} s, got {self.max_timeout_s}",
                setting="max_timeout_s",
                value=self.max_timeout_s,
            )
        for name in _TIMEOUT_SETTINGS:
            value = getattr(self, name)
            if _finite_seconds(value, name) > maximum:
                raise ConfigError(
                    f"{name}={value} is longer than max_timeout_s={maximum}; raise max_timeout_s "
                    "or shorten it",
                    setting=name,
                    value=value,
                )
        for name in (
            "max_concurrent_transfers",
            "max_queued_transfers",
            "max_expected_requests",
            "verbs_port",
            "verbs_signal_every",
            "verbs_queue_depth",
            "max_cached_peers",
            "max_mapped_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive", setting=name, value=getattr(self, name))
        if self.copy_threads < 0:
            raise ConfigError(
                f"copy_threads must be 0 (pick) or a number of threads, got {self.copy_threads}",
                setting="copy_threads",
                value=self.copy_threads,
            )
        rate = self.integrity_sample_rate
        if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 <= rate <= 1.0:
            raise ConfigError(
                f"integrity_sample_rate must be a share of requests from 0.0 to 1.0, got {rate!r}",
                setting="integrity_sample_rate",
                value=rate,
            )
        if self.verbs_gid_index < -1:
            raise ConfigError(
                f"verbs_gid_index must be a GID table index, or -1 to pick one, got {self.verbs_gid_index}",
                setting="verbs_gid_index",
                value=self.verbs_gid_index,
            )
        if not 0 <= self.notice_port <= 65535:
            raise ConfigError(
                f"notice_port must be a TCP port (0 picks a free one), got {self.notice_port}",
                setting="notice_port",
                value=self.notice_port,
            )
        if self.notice_ports < 1 or self.notice_port + self.notice_ports - 1 > 65535:
            raise ConfigError(
                f"notice_ports must be at least 1, and notice_port + notice_ports - 1 a TCP port; got "
                f"notice_port={self.notice_port}, notice_ports={self.notice_ports}",
                setting="notice_ports",
                value=self.notice_ports,
            )
        if self.notice_host:
            try:
                ipaddress.ip_address(self.notice_host)
            except ValueError:
                raise ConfigError(
                    f"notice_host must be an IP address of this node (or empty: Ray's node "
                    f"address), got {self.notice_host!r}",
                    setting="notice_host",
                    value=self.notice_host,
                ) from None
        if not self.verbs_device:
            raise ConfigError(
                'verbs_device must name an RDMA device (e.g. "mlx5_0") or be "auto"',
                setting="verbs_device",
                value=self.verbs_device,
            )

    def deadline(self, value: object, default: float, name: str, *, allow_zero: bool = False) -> float:
        """Seconds a wait given by a caller may take: `default` when `value` is None, else
        `value` clamped to `max_timeout_s`. NaN, infinities, non-numbers and values not above
        zero (zero allowed with `allow_zero`: "do not wait") raise `ConfigError` naming `name`."""
        if value is None:
            return default
        return min(_finite_seconds(value, name, allow_zero=allow_zero), self.max_timeout_s)

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


#: The variable that may hold the hand-off key the engines of one P/D deployment share (hex
#: digits; see `kvray.integrations.vllm.tickets`), when their configuration does not name one.
HANDOFF_KEY_VARIABLE = "KVRAY_HANDOFF_KEY"


def handoff_key_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The hand-off key from the environment, or None."""
    environ = os.environ if environ is None else environ
    return environ.get(HANDOFF_KEY_VARIABLE) or None
