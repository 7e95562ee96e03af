"""``RouterConfig``: every router setting and its default, in one place.

The CLI (``python -m eldr_sglang.router``, ``eldr-router``) builds its flags from
these fields, the deploy generator and the demo pass flags named after them, and
tests build a ``Router`` with keyword overrides of the same names.
"""

from __future__ import annotations

import ipaddress
import json
import os
import resource
import socket
import urllib.parse
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any, Mapping, Optional, get_type_hints

import pydantic

# SGLang's HTTP server (uvicorn) closes idle keep-alive connections after 5 s
# (SGLANG_TIMEOUT_KEEP_ALIVE); the router drops them first, else reusing one races
# with its close and a request fails ("Server disconnected").
WORKER_KEEPALIVE_S = 3.0
# file descriptors one routed request holds: client, prefill and decode connections
FDS_PER_REQUEST = 3
FDS_RESERVED = 64  # listeners, health checks, signature streams, logs
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _opt(help: str, default: Any = None, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class RouterConfig:
    """Router settings (seconds, MiB, counts). ``None`` means "derived" where said."""

    # routing
    policy: str = _opt("decode-routing policy (see --help for the names)", "eldr_balanced")
    calibration: Optional[str] = _opt("calibration artifact (needed by artifact policies)")
    tau: Optional[float] = _opt("the eldr policy's tau parameter (an alias of --policy-param tau=...); "
                                "default: the artifact's tau (0 included)")
    policy_param: tuple[str, ...] = _opt(
        "a parameter of the policy as NAME=VALUE; repeat (each policy's parameters and defaults: --help, "
        "or python -m tools.policy_table). In a config file, a mapping of NAME: VALUE or a list of NAME=VALUE",
        (), repeat=True)
    domain_map: Optional[str] = _opt("JSON (inline or file): label -> [decode index or URL, ...]")
    label_field: Optional[str] = _opt("body field holding the request label (removed before forwarding)")
    label_header: Optional[str] = _opt("HTTP header holding the request label")
    seed: Optional[int] = _opt("seed of the policies' random tie-breaks", 0)
    # routing before prefill (eldr_sglang.router.colocated, eldr_sglang.router.signals.scoring)
    mode: str = _opt("pd: prefill/decode router; colocated: whole requests across plain SGLang "
                     "servers (--worker), routed by the artifact's predicted signature", "pd",
                     choices=("pd", "colocated"))
    tokenizer: Optional[str] = _opt("model folder whose tokenizer turns prompts into token ids for "
                                    "predicted signatures (default: the one the artifact names)")
    binding: str = _opt("PD: late (decode chosen with the prefill's signature), early (chosen at arrival "
                        "from the predicted signature; prefill and decode sent together), auto (early when "
                        "the prediction's best region leads the second by --binding-margin)", "late",
                        choices=("late", "early", "auto"))
    binding_margin: float = _opt("--binding auto: least similarity margin between the best two predicted "
                                 "regions for early binding", 0.02)
    # A/B and shadow (eldr_sglang.router.state.ab)
    ab_policies: Optional[str] = _opt(
        "time-sliced A/B: comma-separated policies the router alternates, one per slice "
        "(e.g. eldr,jsq; --policy is then unused)")
    ab_slice: float = _opt("seconds per A/B slice (also the record period of --ab-record)", 600.0)
    ab_record: Optional[str] = _opt(
        "append one JSON line per slice here (arm, requests, latency, and decode steps, batch "
        "and distinct experts from --engine-metrics); python -m eldr_sglang.ab gives the verdict")
    ab_label: Optional[str] = _opt("arm name in --ab-record when one policy runs (pool-split A/B)")
    engine_metrics: Optional[str] = _opt(
        "comma-separated engine plugin metrics URLs (--eldr-metrics-port endpoints), in "
        "--decode order: A/B slices read their counters; every --load-interval the router reads "
        "each server's live batch and step samples there (GET /eldr/batch), prices the true batch "
        "and fits the server's step law")
    shadow_policy: Optional[str] = _opt(
        "route by --policy, and count (and log per decision) what this policy would have chosen")
    # online calibration (eldr_sglang.core.online)
    online: bool = _opt(
        "learn the calibration from live signatures: route by load until "
        "--online-min-signatures arrived, fit (K = decode servers), then refit on drift, "
        "membership changes and --online-refit-every; --calibration is the starting point "
        "when given", False, flag=True)
    online_min_signatures: int = _opt("signatures before the first online fit (and in a fit after drift)", 2000)
    online_window: int = _opt("most recent signatures kept for online fits", 20000)
    online_refit_every: int = _opt("periodic online refit after this many signatures (0: off)", 0)
    online_drift_window: int = _opt("recent signatures compared with the fit for drift", 512)
    online_drift_ks: float = _opt(
        "drift: refit when the KS distance of best-centroid similarity exceeds this", 0.2)
    online_drift_shift: float = _opt(
        "drift: refit when the total-variation distance of region shares exceeds this", 0.2)
    online_fit_in: str = _opt("where online fits run, off the event loop", "process",
                              choices=("process", "thread"))
    calibration_out: Optional[str] = _opt(
        "write the live artifact here (atomically) on every online swap; restart with "
        "--calibration at the same path to continue from it")
    calibration_watch: float = _opt(
        "seconds between checks of --calibration for a newer file, reloaded when it "
        "changes (router replicas following one --online router; 0: off)", 0.0)
    # signatures
    signature_timeout: float = _opt(
        "longest wait for a prefill signature before falling back to least loaded (the "
        "adaptive wait's ceiling)", 10.0)
    signature_timeout_min: float = _opt("shortest adaptive signature wait", 0.5)
    signature_timeout_factor: float = _opt(
        "adaptive signature wait = this x p99 of recent waits, within [min, ceiling] "
        "(0: always the ceiling)", 4.0)
    signature_port: Optional[int] = _opt(
        "TCP port for newline-delimited JSON signature messages (0: any free port; "
        "engines publish to the address each request carries)")
    advertise_host: Optional[str] = _opt(
        "host engines reach this router's signature port at (default: --host, or this "
        "machine's address when --host is a wildcard)")
    signature_ttl: float = _opt("seconds an early (unclaimed) signature message is kept", 10.0)
    signature_buffer: int = _opt("max early (unclaimed) signature messages kept", 4096)
    signature_buffer_mb: float = _opt("max MiB of early signature messages kept", 64.0)
    signature_max_kb: float = _opt("largest signature message (KiB); larger is refused", 1024.0)
    signature_max_age: float = _opt(
        "seconds a signature message's timestamp (inside its HMAC) may differ from this "
        "router's clock; older or newer is refused, and so is a second message for one "
        "bootstrap room (a replay)", 60.0)
    signature_max_streams: int = _opt(
        "signature stream (--signature-port) connections open at once; more are closed at once", 256)
    signature_stream_idle: float = _opt(
        "seconds a signature stream connection may send nothing; then it is closed (engines "
        "reconnect at their next message)", 300.0)
    signature_line_timeout: float = _opt(
        "seconds a signature stream has to finish a line once it started it; then closed", 10.0)
    signature_key_file: Optional[str] = _opt(
        "file holding the key engines sign signature messages with (HMAC-SHA256); unsigned or "
        "wrongly signed ones are refused (default: env ELDR_SIGNATURE_KEY; none: taken unsigned)")
    # workers: health, breaker, load
    health_interval: float = _opt("seconds between GET /health checks of every worker (0: off)", 5.0)
    health_timeout: float = _opt("health check timeout", 2.0)
    health_failures: int = _opt("consecutive failed health checks that take a worker out", 2)
    health_cooldown: float = _opt("seconds an open circuit breaker waits before one trial request", 10.0)
    breaker_threshold: int = _opt(
        "consecutive failed requests that open a worker's breaker (a refused connection opens it at once)", 5)
    load_interval: float = _opt(
        "seconds between polls of the decode servers' load (GET /v1/loads; 0: own in-flight "
        "counts only)", 0.5)
    routers: int = _opt(
        "routers sharing the decode servers, R = this x --workers (0: estimated): own requests "
        "since a load poll count 1 + (R - 1)/2 times", 1)
    # timeouts to workers
    connect_timeout: float = _opt("connect timeout to a worker", 5.0)
    first_byte_timeout: float = _opt(
        "longest wait for a worker's answer headers (a non-streamed decode answers only "
        "when done: raise it for very long generations)", 300.0)
    idle_timeout: float = _opt("longest gap between two chunks of a worker's answer", 60.0)
    request_timeout: float = _opt("total limit of one worker request", 1800.0)
    # admission and limits
    max_inflight: int = _opt(
        "client requests served at once; above it 429 + Retry-After (0: from the open-file "
        "limit, (RLIMIT_NOFILE - 64) / 3)", 0)
    retry_after: float = _opt("Retry-After seconds sent with 429/503", 1.0)
    max_batch: int = _opt("largest batch (items of 'text'/'input_ids'); larger gets 413", 256)
    max_body_mb: float = _opt("largest request body (MiB); larger gets 413", 32.0)
    decisions_kept: int = _opt("routing decisions kept for GET /eldr/decisions", 256)
    client_header_timeout: float = _opt(
        "seconds a client has to send a request's headers (from its first byte, or from "
        "connecting); then the connection is closed (0: no limit)", 10.0)
    client_body_timeout: float = _opt(
        "seconds a client has to send a request's body; then 408 (0: no limit)", 60.0)
    worker_max_connections: int = _opt(
        "connections open at once to one worker (streams hold one each); above it requests "
        "queue in the router, never counted against the worker (0: no limit)", 1024)
    # client and worker authentication, request ids (as sglang-router)
    api_key: Optional[str] = _opt(
        "clients must send 'Authorization: Bearer KEY' on the generate and OpenAI routes, "
        "else 401 (default: env ELDR_API_KEY; none: open)")
    worker_api_key: Optional[str] = _opt(
        "sent to every worker as 'Authorization: Bearer KEY' (engines started with --api-key; "
        "default: env ELDR_WORKER_API_KEY)")
    request_id_headers: str = _opt(
        "comma-separated request-id headers read from clients (first present wins), forwarded "
        "to the workers and echoed in the answer; one is made up when none is sent",
        "x-request-id,x-correlation-id,x-trace-id,request-id")
    # admin and logs
    admin_token: Optional[str] = _opt(
        "require 'Authorization: Bearer TOKEN' on admin endpoints (default: loopback clients only)")
    log_decisions: bool = _opt("log every routing decision at INFO (otherwise DEBUG)", False, flag=True)
    log_format: str = _opt("log lines as text or as one JSON object per line", "text", choices=("text", "json"))
    access_log: bool = _opt(
        "log one line per client request (remote, method, path, status, duration, bytes, request id) "
        "to the logger eldr_sglang.router.access at INFO", False, flag=True)
    cors_origins: Optional[str] = _opt(
        "comma-separated origins browsers may call the router from (CORS, e.g. https://app.example; "
        "'*': any); none: no CORS headers")
    # process
    host: str = _opt("listen address", "0.0.0.0")
    port: int = _opt("listen port", 8000)
    workers: int = _opt("router processes sharing --port (SO_REUSEPORT)", 1)
    drain_timeout: float = _opt("on SIGTERM: seconds to let in-flight requests finish", 30.0)
    log_level: str = _opt("log level", "info", choices=LOG_LEVELS)
    event_loop: str = _opt("auto: uvloop when installed", "auto", choices=("auto", "uvloop", "asyncio"))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Convert each field to its declared type, then check the values; ValueError
        naming the first bad field."""
        if isinstance(self.policy_param, Mapping):  # code and config files: {name: value}
            self.policy_param = tuple(f"{k}={v}" for k, v in self.policy_param.items())
        elif isinstance(self.policy_param, str):
            self.policy_param = (self.policy_param,)
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not f.default:
                setattr(self, f.name, typed_value(f.name, value))
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name}: {getattr(self, f.name)!r} is not one of {', '.join(choices)}")
        self._check_policies()
        self._check_policy_params()
        from eldr_sglang.router.http.http_conventions import cors_origins_of

        cors_origins_of(self.cors_origins)  # ValueError naming cors_origins
        if self.domain_map is not None:
            domain_map_of(self.domain_map)
        positive = ("signature_timeout", "signature_ttl", "signature_buffer", "signature_buffer_mb",
                    "signature_max_kb", "signature_max_age", "signature_max_streams",
                    "signature_stream_idle", "signature_line_timeout", "health_timeout", "health_failures", "breaker_threshold",
                    "connect_timeout", "first_byte_timeout", "idle_timeout", "request_timeout",
                    "max_batch", "max_body_mb", "workers", "retry_after")
        non_negative = ("signature_timeout_min", "signature_timeout_factor", "health_interval",
                        "health_cooldown", "load_interval", "max_inflight", "decisions_kept",
                        "drain_timeout", "calibration_watch", "binding_margin", "routers")
        if not self.ab_slice > 0:
            raise ValueError(f"ab_slice: expected a number > 0, got {self.ab_slice!r}")
        if self.ab_policies is not None:
            names = [p.strip() for p in self.ab_policies.split(",") if p.strip()]
            if len(names) < 2:
                raise ValueError("ab_policies: give at least two policies, e.g. eldr,jsq")
            if self.online:
                raise ValueError("ab_policies: not with --online (a refit mid-slice would mix arms)")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected a number > 0, got {getattr(self, name)!r}")
        for name in non_negative:
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: expected a number >= 0, got {getattr(self, name)!r}")
        if self.tau is not None:  # checked where the eldr policy declares it
            from eldr_sglang.core.policies.eldr import EldrParams

            EldrParams(self.tau)
        for name in ("port", "signature_port"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 65535:
                raise ValueError(f"{name}: expected 0-65535, got {v}")
        if self.signature_port and self.signature_port == self.port:
            raise ValueError(f"signature_port: {self.signature_port} is the router's port; pick another")
        if self.online:
            self.online_settings()
        self.signature_key()  # a bad key file fails here, naming the field
        if self.calibration_watch and not self.calibration:
            raise ValueError("calibration_watch: needs --calibration (the file to follow)")
        if self.calibration_watch and self.online:
            raise ValueError("calibration_watch: an --online router writes the calibration, it "
                             "does not follow one")
        if self.online and self.workers > 1 and not self.calibration_out:
            raise ValueError("calibration_out: --online with --workers > 1 needs it (process 0 "
                             "fits and writes it, the others follow it)")
        if self.workers > 1 and self.port == 0:
            raise ValueError("workers: several processes need a fixed --port to share")
        if self.workers > 1 and self.mode == "pd" and self.signature_port is None:
            raise ValueError(f"signature_port: --workers {self.workers} needs it: on the shared --port "
                             "a POST /eldr/signature reaches any process, not the one waiting for "
                             "its request; add --signature-port PORT (process i takes PORT + i; 0: "
                             "any free port), which each request names as its return address")

    def _check_policies(self) -> None:
        from eldr_sglang.core.policies import policy_names

        known = ", ".join(policy_names(aliases=True))
        for name in ("policy", "shadow_policy"):
            value = getattr(self, name)
            if value is not None and value not in policy_names(aliases=True):
                raise ValueError(f"{name}: unknown policy {value!r} (known: {known})")
        for arm in (self.ab_policies or "").split(","):
            if arm.strip() and arm.strip() not in policy_names(aliases=True):
                raise ValueError(f"ab_policies: unknown policy {arm.strip()!r} (known: {known})")

    def policy_specs(self) -> list[Any]:
        """The PolicySpecs this router builds: ``--policy`` (or the A/B arms), the shadow."""
        from eldr_sglang.core.policies import policy_spec

        names = ([a.strip() for a in self.ab_policies.split(",") if a.strip()] if self.ab_policies
                 else [self.policy])
        if self.shadow_policy:
            names.append(self.shadow_policy)
        specs = [policy_spec(n) for n in names]
        return list({s.name: s for s in specs}.values())

    def policy_params(self) -> dict[str, str]:
        """``policy_param`` as name -> value text (a later NAME wins); ValueError naming the field."""
        from eldr_sglang.core.policies.params import split_assignments

        return split_assignments(self.policy_param)

    def _check_policy_params(self) -> None:
        from eldr_sglang.core.policies.params import check_params

        try:
            check_params(self.policy_specs(), self.policy_params())
        except ValueError as e:
            raise ValueError(f"policy_param: {str(e).removeprefix('policy_param: ')}") from None

    def ignored_settings(self) -> list[str]:
        """Settings given that no policy of this router reads (each a warning at start)."""
        from eldr_sglang.core.policies.params import param_names

        specs = self.policy_specs()
        names = ", ".join(s.name for s in specs)
        out = []
        if self.tau is not None and not any("tau" in param_names(s.params) for s in specs):
            out.append(f"--tau {self.tau:g} is ignored: policy {names} has no similarity band "
                       "(only eldr reads it)")
        if self.domain_map is not None and not any(s.needs_domain_map for s in specs):
            out.append(f"--domain-map is ignored: policy {names} does not route by label (only domain reads it)")
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "RouterConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown router setting(s): {', '.join(unknown)}")
        return cls(**values)

    # ------------------------------------------------------------ derived values
    def online_settings(self) -> Any:
        """The :class:`~eldr_sglang.core.online.OnlineSettings` of the ``online_*`` fields
        (ValueError naming the flag)."""
        from eldr_sglang.core.artifact import DEFAULT_TAU
        from eldr_sglang.core.online import OnlineSettings

        try:
            return OnlineSettings(
                min_signatures=self.online_min_signatures, window=self.online_window,
                refit_every=self.online_refit_every, drift_window=self.online_drift_window,
                drift_ks=self.online_drift_ks, drift_shift=self.online_drift_shift,
                tau=DEFAULT_TAU if self.tau is None else self.tau,
                seed=0 if self.seed is None else self.seed)
        except ValueError as e:  # "online window (...)" -> "online_window: ..."
            words = str(e).split()
            name = "online_" + words[1].rstrip(":") if len(words) > 1 else "online"
            raise ValueError(f"{name}: {e}") from None

    def signature_key(self) -> Optional[bytes]:
        """The signature messages' shared key: ``signature_key_file``'s, else
        ``$ELDR_SIGNATURE_KEY``'s, else None (ValueError naming the field)."""
        from eldr_sglang.core.wire import load_key

        return load_key(self.signature_key_file, "signature_key_file")

    @property
    def inflight_limit(self) -> int:
        """``max_inflight``, or what the open-file limit allows."""
        if self.max_inflight:
            return self.max_inflight
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
        return max(1, (soft - FDS_RESERVED) // FDS_PER_REQUEST)

    def signature_host_for(self, bound_host: str) -> str:
        """The host engines use to reach this router's signature port (bound on
        ``bound_host``)."""
        if self.advertise_host:
            return self.advertise_host
        try:
            if not ipaddress.ip_address(bound_host).is_unspecified:
                return bound_host
        except ValueError:
            return bound_host  # a host name
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"


def validate_worker_url(url: Any) -> str:
    """``http(s)://host[:port]`` without path, query or credentials; ValueError otherwise.

    Returns the URL without a trailing slash."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"worker URL must be a non-empty string, got {url!r}")
    u = urllib.parse.urlsplit(url.rstrip("/"))
    if u.scheme not in ("http", "https"):
        raise ValueError(f"worker URL {url!r}: scheme must be http or https")
    if not u.hostname:
        raise ValueError(f"worker URL {url!r}: no host")
    try:
        u.port
    except ValueError:
        raise ValueError(f"worker URL {url!r}: bad port") from None
    if u.path or u.query or u.fragment or u.username or u.password:
        raise ValueError(f"worker URL {url!r}: only scheme://host:port is allowed")
    return url.rstrip("/")


@lru_cache(maxsize=None)
def _hints() -> dict[str, Any]:
    return get_type_hints(RouterConfig)


@lru_cache(maxsize=None)
def _adapter(hint: Any) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(hint, config=pydantic.ConfigDict(coerce_numbers_to_str=True))


def typed_value(name: str, value: Any) -> Any:
    """``value`` as the declared type of :class:`RouterConfig` field ``name`` (pydantic's
    rules: ``"no"``/``"off"``/``0`` are false, ``"3"`` is 3, ``"many"`` is no number);
    ValueError naming the field."""
    hint = _hints()[name]
    if isinstance(value, bool) and bool not in getattr(hint, "__args__", (hint,)):
        raise ValueError(f"{name}: expected {_type_name(hint)}, got {value!r}")
    try:
        return _adapter(hint).validate_python(value)
    except pydantic.ValidationError as e:
        raise ValueError(f"{name}: {e.errors()[0]['msg'].lower()}, got {value!r}") from None


def _type_name(hint: Any) -> str:
    return " or ".join(getattr(a, "__name__", str(a)) for a in getattr(hint, "__args__", (hint,)))


def domain_map_of(value: str) -> dict[str, list]:
    """``--domain-map``: inline JSON or a JSON file of label -> [decode index or URL, ...]
    (a single server may stand without its list); ValueError naming ``domain_map``."""
    source = value
    if os.path.exists(value):
        try:
            with open(value) as f:
                value = f.read()
        except OSError as e:
            raise ValueError(f"domain_map: cannot read {source} ({e.strerror})") from None
    try:
        doc = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"domain_map: {source!r} is not JSON ({e.msg} at line {e.lineno} column {e.colno}) "
                         "nor a file") from None
    if not isinstance(doc, dict):
        raise ValueError(f"domain_map: expected a JSON object of label -> servers, got {type(doc).__name__}")
    for label, servers in doc.items():
        for s in servers if isinstance(servers, list) else [servers]:
            if isinstance(s, bool) or not isinstance(s, (int, str)):
                raise ValueError(f"domain_map: {label!r}: a server is a decode index or URL, got {s!r}")
    return doc
