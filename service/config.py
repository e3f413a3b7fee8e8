"""Daemon configuration: defaults < YAML file < KVXFER_* environment < command-line flags.

Every value is validated at start-up; a bad one is a one-line ``ConfigError`` naming
the setting. Unknown keys are errors too, so a typo never passes silently.
"""

from __future__ import annotations

import difflib
import os
import re
import ssl
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

from kvxfer.core.defaults import DEFAULT_POOL
from kvxfer.core.errors import ConfigError, InvalidArgument
from kvxfer.core.validate import MAX_BATCH_BLOCKS, POOL_ID_RE, shown
from kvxfer.events.settings import EventSettings
from kvxfer.geometry.layout import KVSpec, Layout, parse_dtype
from kvxfer.index.admission import AdmissionSettings
from kvxfer.index.tenancy import Tenant
from kvxfer.memory.shm import resolve_group
from kvxfer.peering.settings import PeeringSettings
from kvxfer.serving.pool_registry import Limits
from kvxfer.serving.prefetch import HintSettings
from kvxfer.tiers.host import capacity_blocks
from kvxfer.tiers.registry import LOWER_TIERS
from kvxfer.tiers.sections import RENAMED
from kvxfer.wire.descriptor_frames import SUFFIX
from service import config_sections as sections
from service.config_peering import peering as peering_section


@dataclass(frozen=True)
class PoolConfig:
    id: str
    device: str  # "cpu", "cuda", "cuda:N", or "auto" (cuda:0 when a GPU is present)
    layout: Layout
    spec: KVSpec
    host_capacity_mib: float
    cache_group: str = ""


@dataclass(frozen=True)
class Config:
    socket: str = "/tmp/kvxfer.sock"
    socket_mode: int = 0o660
    socket_group: str = ""
    listen: str = ""  # HOST:PORT; needs tls_cert, tls_key and a token
    # HOST:PORT of /metrics (Prometheus); "" turns it off. Not 9400: dcgm-exporter has it on every GPU node.
    metrics_listen: str = "127.0.0.1:9470"
    tls_cert: str = ""
    tls_key: str = ""
    token_file: str = ""
    max_concurrent_rpcs: int = 64
    workers: int = 16
    max_message_mib: int = 64
    max_streams_per_connection: int = 128
    max_batch_blocks: int = MAX_BATCH_BLOCKS
    grace_period_s: float = 10.0
    max_pools: int = 8
    max_cache_groups: int = 8
    cache_group_retention_s: float = 300.0
    max_queued_jobs: int = 256
    max_jobs_per_client: int = 0  # 0: a quarter of max_queued_jobs (at least 1)
    default_lease_s: float = 30.0
    max_lease_s: float = 600.0
    allow_register: bool = True
    registered_host_capacity_mib: int = 512
    registered_ranks: int = 1  # engine ranks expected to register: --check and start count their host tiers
    checksum_on_device: bool = True
    copy_threads: int = 2
    gpu_copy_deadline_s: float = 30.0
    log_level: str = "info"
    log_format: str = "json"
    allow_overcommit: bool = False  # start even when pools and tiers exceed the memory free here
    pools: tuple[PoolConfig, ...] = field(default_factory=tuple)
    #: every cache group's lower tiers, settings by config section (``disk``, ``shared_fs``, ``remote``, ...: the
    #: rows of ``kvxfer.tiers.registry.LOWER_TIERS``); a section absent: no such tier
    tiers: dict[str, object] = field(default_factory=dict)
    events: EventSettings = field(default_factory=EventSettings)  # KV events: replay buffer, publisher
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)  # which new blocks offloads store
    hints: HintSettings = field(default_factory=HintSettings)  # RETAIN's TTL cap, hinted shares, prefetch queue
    tenants: tuple[Tenant, ...] = ()  # guaranteed shares of every host and disk tier (kvxfer.index.tenancy)
    peering: PeeringSettings | None = None  # other nodes' daemons, read over NIXL; absent: none
    notes: tuple[str, ...] = ()  # warnings loading found (renamed keys): serve --check prints them, serve logs them

    @property
    def limits(self) -> Limits:
        return Limits(self.max_pools, self.max_cache_groups, self.max_queued_jobs, self.default_lease_s,
                      self.max_lease_s, self.allow_register, self.registered_host_capacity_mib,
                      self.jobs_per_client, self.cache_group_retention_s, self.checksum_on_device,
                      self.copy_threads, self.gpu_copy_deadline_s, self.allow_overcommit)

    @property
    def jobs_per_client(self) -> int:
        """``max_jobs_per_client``, or (0) a quarter of ``max_queued_jobs``: setting the queue's bound alone
        is enough."""
        return self.max_jobs_per_client or max(1, self.max_queued_jobs // 4)

    @property
    def token(self) -> str:
        if not self.token_file:
            return ""
        return Path(self.token_file).read_text().strip()


_SECTIONS = ("pools", "events", "admission", "hints", "tenants", "peering")  # and each lower tier's (``_sections``)
_SCALARS = {f.name: f for f in fields(Config) if f.name not in (*_SECTIONS, "tiers", "notes")}
_MODES = {"socket_mode"}
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
_ENV_PREFIX = "KVXFER_"
_LISTEN_RE = re.compile(r"(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")
_TOKEN_RE = re.compile(r"[\x21-\x7e]{1,256}")


def _coerce(name: str, value, source: str = "the config file") -> object:
    """One scalar setting from YAML, environment or flags, validated to its exact type; the
    message names where the value came from."""
    kind = _SCALARS[name].type
    try:
        if name in _MODES:
            mode = int(str(value), 8) if isinstance(value, str) else int(value)
            if not 0 <= mode <= 0o777:
                raise ValueError
            return mode
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text not in {"true", "false", "1", "0", "yes", "no"}:
                raise ValueError
            return text in {"true", "1", "yes"}
        if kind == "int":
            if isinstance(value, bool | float):  # 2.7 threads is a mistake, not 2
                raise ValueError
            return int(str(value).strip()) if isinstance(value, str) else int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        return "" if value is None else str(value)
    except (TypeError, ValueError, OverflowError):
        expected = {"int": "an integer", "float": "a number", "bool": "true or false"}.get(str(kind), "a value")
        if name in _MODES:
            expected = "an octal mode such as 0660"
        raise ConfigError(f"{name} (from {source}): invalid value {shown(value)}, expected {expected}") from None


def _unknown(names: set[str], known: list[str], where: str) -> ConfigError:
    """An unknown-key error that suggests the nearest known key for each."""
    hints = []
    for name in sorted(names):
        near = difflib.get_close_matches(str(name), known, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    return ConfigError(f"{where}unknown settings [{', '.join(hints)}]; docs/configuration.md lists every key")


#: KVXFER_* variables the library reads that are not settings.
OTHER_VARIABLES = ("KVXFER_NATIVE", "KVXFER_LMCACHE_PYTHON", "KVXFER_DEVCHECK_SITE")


def unknown_variables(env: dict[str, str] | None = None) -> list[str]:
    """A line for each KVXFER_* variable that nothing reads (a misspelt one is otherwise ignored in silence)."""
    env = os.environ if env is None else env
    known = [_ENV_PREFIX + name.upper() for name in _SCALARS] + list(OTHER_VARIABLES)
    lines = []
    for name in sorted(k for k in env if k.startswith(_ENV_PREFIX) and k not in known):
        near = difflib.get_close_matches(name, known, n=1)
        lines.append(f"environment variable {name} names no setting and is ignored"
                     + (f" (did you mean {near[0]}?)" if near else ""))
    return lines


def _renamed_keys(raw: dict) -> tuple[str, ...]:
    """A line for each renamed key the file gives (read as its new key: ``tiers.sections.RENAMED``)."""
    return tuple(f"{section}.{old} is renamed {section}.{new} (every size is in MiB): read as {new}; rename it"
                 for (section, old), (new, _) in RENAMED.items()
                 if isinstance(raw.get(section), dict) and old in raw[section])


def _pool(raw: dict, index: int) -> PoolConfig:
    where = f"pools[{index}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping")
    unknown = set(raw) - set(DEFAULT_POOL)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(DEFAULT_POOL)}")
    if not isinstance(raw.get("spec") or {}, dict):
        raise ConfigError(f"{where}.spec: must be a mapping of {sorted(DEFAULT_POOL['spec'])}")
    merged = {**DEFAULT_POOL, **raw, "spec": {**DEFAULT_POOL["spec"], **(raw.get("spec") or {})}}
    pool_id = str(merged["id"])
    if not POOL_ID_RE.fullmatch(pool_id):
        raise ConfigError(f"{where}.id: {shown(pool_id)} must be 1-64 letters, digits, '_', '.', '-'")
    cache_group = str(merged["cache_group"] or "")
    if cache_group and not POOL_ID_RE.fullmatch(cache_group):
        raise ConfigError(f"{where}.cache_group: {shown(cache_group)} must be 1-64 letters, digits, '_', '.', '-'")
    device = str(merged["device"])
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise ConfigError(f"{where}.device: {shown(device)} must be auto, cpu, cuda or cuda:N")
    try:
        spec_raw = dict(merged["spec"])
        unknown = set(spec_raw) - set(DEFAULT_POOL["spec"])
        if unknown:
            raise ConfigError(f"{where}.spec: unknown keys {sorted(unknown)}")
        spec_raw["dtype"] = parse_dtype(str(spec_raw["dtype"]))
        spec = KVSpec(**spec_raw)
        layout = Layout.parse(str(merged["layout"]))
    except ConfigError:
        raise
    except InvalidArgument as exc:  # the config's words, not the library's class names
        raise ConfigError(f"{where}: {str(exc).replace('KVSpec.', 'spec.')}") from None
    capacity = merged["host_capacity_mib"]
    if isinstance(capacity, bool) or not isinstance(capacity, int | float) or capacity <= 0:
        raise ConfigError(f"{where}.host_capacity_mib: must be a positive number, got {shown(capacity)}")
    try:
        capacity_blocks(capacity, spec.block_bytes)
    except InvalidArgument as exc:
        raise ConfigError(f"{where}.host_capacity_mib: {exc}") from None
    return PoolConfig(pool_id, device, layout, spec, capacity, cache_group)


def load(path: str | None = None, env: dict[str, str] | None = None, overrides: dict | None = None,
         pool_overrides: dict | None = None) -> Config:
    """Build and validate the configuration from its sources. ``pool_overrides`` (flags such as
    ``--device``; ``num_blocks`` goes into the spec) apply to every configured pool."""
    raw: dict = {}
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: must be a mapping")
        raw = dict(loaded or {})
    tier_sections = [row.section for row in LOWER_TIERS if row.parse is not None]
    unknown = set(raw) - set(_SCALARS) - set(_SECTIONS) - set(tier_sections)
    if unknown:
        raise _unknown(unknown, [*_SCALARS, *_SECTIONS, *tier_sections], "")
    sources = {name: f"config file {path}" for name in raw}
    env = os.environ if env is None else env
    for name in _SCALARS:
        if _ENV_PREFIX + name.upper() in env:
            raw[name] = env[_ENV_PREFIX + name.upper()]
            sources[name] = f"environment variable {_ENV_PREFIX + name.upper()}"
    for name, value in (overrides or {}).items():
        if value is not None:
            raw[name] = value
            sources[name] = f"flag --{name.replace('_', '-')}"
    values = {name: _coerce(name, raw[name], sources[name]) for name in _SCALARS if name in raw}
    if values.get("registered_ranks") and values.get("allow_register") is False:  # (only as given: 1 is the default)
        raise ConfigError("registered_ranks: set with allow_register false (nothing can register; set it to 0)")
    pools_raw = raw.get("pools")
    if pools_raw is None:
        pools_raw = [{}]
    if not isinstance(pools_raw, list) or not pools_raw:
        raise ConfigError("pools: must be a non-empty list")
    chosen = {k: v for k, v in (pool_overrides or {}).items() if v is not None}
    if chosen:
        spec = {"num_blocks": chosen.pop("num_blocks")} if "num_blocks" in chosen else {}
        pools_raw = [{**p, **chosen, "spec": {**(p.get("spec") or {}), **spec}}
                     if isinstance(p, dict) and isinstance(p.get("spec") or {}, dict) else p  # (else _pool says why)
                     for p in pools_raw]
    pools = tuple(_pool(p, i) for i, p in enumerate(pools_raw))
    if len({p.id for p in pools}) != len(pools):
        raise ConfigError("pools: ids must be unique")
    tiers = {row.section: row.parse(raw.get(row.section)) for row in LOWER_TIERS if row.parse is not None}
    return validate(replace(Config(), **values, pools=pools, tiers={k: v for k, v in tiers.items() if v is not None},
                            events=sections.events(raw.get("events")),
                            admission=sections.admission(raw.get("admission")), hints=sections.hints(raw.get("hints")),
                            tenants=sections.tenants(raw.get("tenants")),
                            peering=peering_section(raw.get("peering")), notes=_renamed_keys(raw)))


def check_key_pair(cert: str, key: str) -> None:
    """The certificate and its key load, and belong together (else the listener would fail at bind, later)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ConfigError(f"tls_cert, tls_key: {cert} and {key} are not a certificate and its private key "
                          f"({exc.reason or exc})") from None


def validate(config: Config) -> Config:
    """Cross-field rules; returns the config unchanged when they hold."""
    if config.log_level.lower() not in {"debug", "info", "warning", "error"}:
        raise ConfigError(f"log_level: {shown(config.log_level)} must be debug, info, warning or error")
    if config.log_format not in {"json", "text"}:
        raise ConfigError(f"log_format: {shown(config.log_format)} must be json or text")
    for name in ("max_concurrent_rpcs", "workers", "max_message_mib", "max_pools", "max_cache_groups",
                 "max_queued_jobs", "max_batch_blocks", "max_streams_per_connection",
                 "registered_host_capacity_mib"):
        if getattr(config, name) < 1:
            raise ConfigError(f"{name}: must be at least 1")
    if not 1 <= config.copy_threads <= 64:
        raise ConfigError("copy_threads: must be 1-64")
    if not 0 < config.gpu_copy_deadline_s <= 3600:
        raise ConfigError("gpu_copy_deadline_s: must be in (0, 3600] seconds")
    if config.max_batch_blocks > MAX_BATCH_BLOCKS:
        raise ConfigError(f"max_batch_blocks: at most {MAX_BATCH_BLOCKS}")
    if config.max_jobs_per_client == 0:
        config = replace(config, max_jobs_per_client=config.jobs_per_client)
    if config.max_jobs_per_client < 1:
        raise ConfigError("max_jobs_per_client: must be at least 1 (or 0: a quarter of max_queued_jobs)")
    if config.max_jobs_per_client > max(1, config.max_queued_jobs // 2):
        raise ConfigError(f"max_jobs_per_client: must be at most half of max_queued_jobs "
                          f"({max(1, config.max_queued_jobs // 2)}), so that one client can never take every job place")
    if config.cache_group_retention_s < 0:
        raise ConfigError("cache_group_retention_s: must be >= 0")
    if not 0 < config.default_lease_s <= config.max_lease_s:
        raise ConfigError("default_lease_s: must be > 0 and at most max_lease_s")
    if not 0 <= config.registered_ranks <= config.max_cache_groups:
        raise ConfigError(f"registered_ranks: must be 0-{config.max_cache_groups} (max_cache_groups): each rank "
                          "that registers its KV memory gets a cache group of its own")
    if len(config.pools) > config.max_pools:
        raise ConfigError(f"pools: {len(config.pools)} configured, max_pools is {config.max_pools}")
    if config.grace_period_s < 0:
        raise ConfigError("grace_period_s: must be >= 0")
    if not config.socket and not config.listen:
        raise ConfigError("nothing to listen on: set socket and/or listen")
    if config.socket:
        longest = len(os.fsencode(config.socket + SUFFIX))
        if longest > MAX_SOCKET_PATH:
            raise ConfigError(f"socket: {shown(config.socket)} is too long: with its descriptor socket "
                              f"({SUFFIX}) {longest} bytes; Unix sockets allow {MAX_SOCKET_PATH}")
        if not Path(config.socket).parent.is_dir():
            raise ConfigError(f"socket: directory {Path(config.socket).parent} does not exist")
    try:
        resolve_group(config.socket_group or None)
    except InvalidArgument as exc:
        raise ConfigError(f"socket_group: {exc}") from None
    for name in ("listen", "metrics_listen"):
        value = getattr(config, name)
        if value and (not _LISTEN_RE.fullmatch(value) or not 0 < int(value.rsplit(":", 1)[1]) < 65536):
            raise ConfigError(f"{name}: {shown(value)} must be HOST:PORT (port 1-65535)")
    if config.listen:
        if not (config.tls_cert and config.tls_key and config.token_file):
            raise ConfigError("listen: a TCP listener needs tls_cert, tls_key and token_file; refusing to "
                              "serve without TLS and a token (use the Unix socket inside the pod)")
    for name in ("tls_cert", "tls_key", "token_file"):
        value = getattr(config, name)
        if value and not Path(value).is_file():
            raise ConfigError(f"{name}: {value} is not a readable file")
    if config.tls_cert and config.tls_key:
        check_key_pair(config.tls_cert, config.tls_key)
    if config.peering is not None and not config.listen:
        raise ConfigError("peering: needs listen (the TLS listener with a token its peers call)")
    if config.peering is not None and not config.peering.tls_cert:  # its identity to peers: the listener's
        config = replace(config, peering=replace(config.peering, tls_cert=config.tls_cert, tls_key=config.tls_key))
    if config.token_file and not _TOKEN_RE.fullmatch(config.token):
        raise ConfigError(f"token_file: {config.token_file} must hold 1-256 printable ASCII characters without "
                          "spaces (it travels in gRPC metadata and on the descriptor socket)")
    return config
