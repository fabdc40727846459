"""The output-rate flags of the vLLM server, and their parsing."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import ipaddress
import json
import os
import re
import socket
from typing import Any

from engine_ext import vllm_compat
from engine_ext.config import DEFAULT_SNAPSHOT_TIMEOUT_S, OutputRateConfig
from engine_ext.identity import (
    MIN_OPERATOR_KEY_LEN,
    MISSING_POLICIES,
    MODES,
    OPERATOR_KEY_ENV,
    IdentityConfig,
)
from engine_ext.metrics import DEFAULT_IDLE_S, DEFAULT_MAX_USERS, MAX_METRICS_USERS
from engine_ext.saved_state import default_state_dir
from output_rate_core.http_guard import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    MAX_TIMEOUT_S,
)
from output_rate_core.ids import MAX_ENGINE_ID_LEN, check_engine_id, check_user_id
from output_rate_core.rates import MAX_RATE, validate_rate

# A DNS name or a dotted IPv4 address (ZMQ resolves it at each dial).
_HOST = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")

# What a host name may hold that an engine id may not (output_rate_core/ids.py): replaced.
_NOT_IN_ENGINE_ID = re.compile(r"[^A-Za-z0-9._:@\[\]-]")
# Room left in an engine id for ":<port>" and a data-parallel rank's "-dp<rank>".
_MAX_HOST_IN_ID = MAX_ENGINE_ID_LEN - len(":65535") - len("-dp9999")

# argparse dest -> flag, for error messages and for reading the namespace.
FLAGS = {
    "default_user_output_tokens_per_second": "--default-user-output-tokens-per-second",
    "user_output_tokens_per_second": "--user-output-tokens-per-second",
    "default_user_output_tokens_per_second_ceiling": (
        "--default-user-output-tokens-per-second-ceiling"
    ),
    "user_output_tokens_per_second_ceiling": "--user-output-tokens-per-second-ceiling",
    "control_plane_endpoint": "--control-plane-endpoint",
    "output_rate_engine_id": "--output-rate-engine-id",
    "control_plane_public_key": "--control-plane-public-key",
    "control_plane_snapshot_timeout": "--control-plane-snapshot-timeout",
    "output_rate_metrics_users": "--output-rate-metrics-users",
    "output_rate_metrics_idle_seconds": "--output-rate-metrics-idle-seconds",
    "output_rate_identity": "--output-rate-identity",
    "output_rate_identity_header": "--output-rate-identity-header",
    "output_rate_identity_missing": "--output-rate-identity-missing",
    "output_rate_http_header_timeout": "--output-rate-http-header-timeout",
    "output_rate_http_idle_timeout": "--output-rate-http-idle-timeout",
    "output_rate_state_dir": "--output-rate-state-dir",
}

# An HTTP header name is a token (RFC 9110 5.1, 5.6.2).
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def parse_rate(text: str) -> int | None:
    if text.strip().lower() in ("null", "none", "unlimited"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer 1..{MAX_RATE} or 'unlimited', got {text!r}"
        ) from None
    try:
        return validate_rate(value, field="rate")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_engine_id(text: str) -> str:
    try:
        return check_engine_id(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"user {key!r} is given twice")
        data[key] = value
    return data


def parse_user_rates(text: str) -> dict[str, int | None]:
    try:
        data = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"is not valid JSON ({e})") from None
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(
            'must be a JSON object like {"user-a": 100, "user-b": null}'
        )
    rates: dict[str, int | None] = {}
    for user, rate in data.items():
        try:
            rates[check_user_id(user)] = validate_rate(rate, field=f"rate of user {user!r}")
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return rates


def _check_tcp_address(address: str) -> None:
    """host:port of a tcp:// endpoint ZMQ can connect to (IPv6 in brackets)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError("needs host:port")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"port must be 1..65535, got {port!r}")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{host} is no IPv6 address") from None
    elif not _HOST.fullmatch(host):
        hint = ""
        with contextlib.suppress(ValueError):
            ipaddress.IPv6Address(host)
            hint = " (an IPv6 address goes in brackets: tcp://[::1]:5557)"
        raise ValueError(f"{host!r} is no host name or IPv4 address{hint}")


def _check_endpoint(entry: str) -> str:
    if entry.startswith("tcp://"):
        _check_tcp_address(entry.removeprefix("tcp://"))
    elif entry.startswith("ipc://"):
        if entry == "ipc://":
            raise ValueError("needs a socket path")
    else:
        raise ValueError("must be tcp://host:port or ipc://path")
    return entry


def parse_endpoint(text: str) -> tuple[str, ...]:
    """One or more comma-separated control-plane replicas, tried in this order."""
    if not text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(
            "must be ZMQ endpoints like tcp://cp-a:5557[,tcp://cp-b:5557] without spaces, "
            f"got {text!r}"
        )
    endpoints = text.split(",")
    for entry in endpoints:
        if not entry:
            raise argparse.ArgumentTypeError(f"has an empty entry in {text!r}")
        try:
            _check_endpoint(entry)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{entry!r} is no ZMQ endpoint: {e}") from None
    if len(set(endpoints)) != len(endpoints):
        twice = next(e for e in endpoints if endpoints.count(e) > 1)
        raise argparse.ArgumentTypeError(f"names {twice!r} twice")
    return tuple(endpoints)


def parse_metrics_users(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_METRICS_USERS:
        raise argparse.ArgumentTypeError(f"must be an integer 0..{MAX_METRICS_USERS}, got {text!r}")
    return value


def parse_idle_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 86_400:
        raise argparse.ArgumentTypeError(f"must be seconds in (0, 86400], got {text!r}")
    return value


def parse_http_timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"must be seconds in (0, {MAX_TIMEOUT_S:g}], got {text!r}")
    return value


def check_operator_key(key: str) -> bytes:
    """The operator key as the bytes a request's header carries, or ValueError naming its
    variable."""
    if len(key) < MIN_OPERATOR_KEY_LEN or not all("!" <= c <= "~" for c in key):
        raise ValueError(
            f"{OPERATOR_KEY_ENV} must be at least {MIN_OPERATOR_KEY_LEN} printable ASCII "
            "characters without spaces (e.g. `openssl rand -hex 32`)"
        )
    return key.encode("ascii")


def parse_header_name(text: str) -> str:
    if not _TOKEN.match(text):
        raise argparse.ArgumentTypeError(
            f"must be an HTTP header name (letters, digits and !#$%&'*+-.^_`|~), got {text!r}"
        )
    return text


def parse_state_dir(text: str) -> str:
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"must be a directory path, got {text!r}")
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is no directory")
    return os.path.abspath(text)


def add_flags(parser: Any) -> None:
    group = parser.add_argument_group(
        title="Per-user output rate",
        description="Per-user output-token speed limits (vllm-output-rate). The user comes "
        "from vllm_xargs.output_rate_user unless --output-rate-identity says otherwise; "
        "requests without one share '__anonymous__'.",
    )
    group.add_argument(
        FLAGS["default_user_output_tokens_per_second"],
        type=parse_rate,
        default=None,
        help="Output tokens/s for every user without its own limit (default: unlimited).",
    )
    group.add_argument(
        FLAGS["user_output_tokens_per_second"],
        type=parse_user_rates,
        default=None,
        help='JSON object of per-user limits, e.g. \'{"user-a":100,"user-b":500}\'; '
        "null = unlimited.",
    )
    group.add_argument(
        FLAGS["default_user_output_tokens_per_second_ceiling"],
        type=parse_rate,
        default=None,
        help="Ceiling (tokens/s, above the rate) up to which users of the default limit "
        "may borrow capacity no other user needs (default: none, the rate is hard).",
    )
    group.add_argument(
        FLAGS["user_output_tokens_per_second_ceiling"],
        type=parse_user_rates,
        default=None,
        help="JSON object of per-user ceilings, e.g. '{\"user-a\":400}'; null = none "
        "(the user's rate is hard whatever the default's ceiling).",
    )
    group.add_argument(
        FLAGS["control_plane_endpoint"],
        type=parse_endpoint,
        default=None,
        help="ZMQ endpoint of the output-rate control plane, e.g. tcp://127.0.0.1:5557; "
        "replicas comma-separated (tcp://cp-a:5557,tcp://cp-b:5557): one is used at a time, "
        "the next when it goes silent.",
    )
    group.add_argument(
        FLAGS["output_rate_engine_id"],
        type=parse_engine_id,
        default=None,
        help="Name of this engine in the control plane, unique in the fleet (default: "
        "<hostname>:<port>, the machine's name, not --host); 1-256 letters, digits and "
        ". _ - : @ [ ].",
    )
    group.add_argument(
        FLAGS["control_plane_public_key"],
        default=None,
        help="CURVE public key (Z85) of the control plane; from `output-rate keys`.",
    )
    group.add_argument(
        FLAGS["control_plane_snapshot_timeout"],
        type=float,
        default=DEFAULT_SNAPSHOT_TIMEOUT_S,
        help="Seconds to wait at startup for the control plane's limits before serving "
        "with the limits given on the command line.",
    )
    group.add_argument(
        FLAGS["output_rate_state_dir"],
        type=parse_state_dir,
        default=None,
        help="Directory where the engine keeps the last configuration it applied from the "
        "control plane (limits, API keys, fleet size; one file per engine id, mode 0600), "
        "enforced when it starts while no control plane answers (default: "
        "$VLLM_CACHE_ROOT/output_rate).",
    )
    group.add_argument(
        FLAGS["output_rate_metrics_users"],
        type=parse_metrics_users,
        default=DEFAULT_MAX_USERS,
        help="Users with their own label value on /metrics; the rest are user=__other__ "
        f"(default {DEFAULT_MAX_USERS}).",
    )
    group.add_argument(
        FLAGS["output_rate_metrics_idle_seconds"],
        type=parse_idle_seconds,
        default=DEFAULT_IDLE_S,
        help="A user's /metrics series goes after this many idle seconds "
        f"(default {DEFAULT_IDLE_S:g}).",
    )
    group.add_argument(
        FLAGS["output_rate_identity"],
        choices=MODES,
        default="body",
        help="Who a request is: body = vllm_xargs.output_rate_user as sent (not "
        "authenticated; default), header = the value of --output-rate-identity-header set "
        "by a gateway, api-key = the user of the 'Authorization: Bearer' API key (keys from "
        "the control plane). docs/identity.md.",
    )
    group.add_argument(
        FLAGS["output_rate_identity_header"],
        type=parse_header_name,
        default=None,
        help="With --output-rate-identity header: the header that names the user.",
    )
    group.add_argument(
        FLAGS["output_rate_identity_missing"],
        choices=MISSING_POLICIES,
        default=None,
        help="With --output-rate-identity header: a request without the header is refused "
        "(401, default) or served as '__anonymous__'.",
    )
    group.add_argument(
        FLAGS["output_rate_http_header_timeout"],
        type=parse_http_timeout,
        default=None,
        help="With --output-rate-identity header or api-key: seconds a connection has to "
        f"send a request head (default {DEFAULT_HEADER_TIMEOUT_S:g}; its size is bounded by "
        "--h11-max-incomplete-event-size).",
    )
    group.add_argument(
        FLAGS["output_rate_http_idle_timeout"],
        type=parse_http_timeout,
        default=None,
        help="With --output-rate-identity header or api-key: seconds a request body, or the "
        f"reading of a response, may pause (default {DEFAULT_IDLE_TIMEOUT_S:g}).",
    )


def default_engine_id(port: int | None, hostname: str | None = None) -> str:
    """``<hostname>:<port>``: the machine's name (never the address the server binds,
    ``0.0.0.0`` on every pod alike), so engines on one host differ by port and engines
    on different hosts by name. Characters an engine id may not hold become ``-``."""
    host = _NOT_IN_ENGINE_ID.sub("-", hostname if hostname is not None else socket.gethostname())
    host = host[:_MAX_HOST_IN_ID].strip(".") or "localhost"
    return f"{host}:{port}" if port else host


def config_from_args(args: argparse.Namespace) -> OutputRateConfig:
    engine_id = getattr(args, "output_rate_engine_id", None)
    if engine_id is None:
        engine_id = default_engine_id(getattr(args, "port", None))
    try:
        check_engine_id(engine_id)
    except ValueError as e:
        raise ValueError(f"{FLAGS['output_rate_engine_id']}: {e}") from None
    return OutputRateConfig(
        default_rate=getattr(args, "default_user_output_tokens_per_second", None),
        user_rates=dict(getattr(args, "user_output_tokens_per_second", None) or {}),
        default_ceiling=getattr(args, "default_user_output_tokens_per_second_ceiling", None),
        user_ceilings=dict(getattr(args, "user_output_tokens_per_second_ceiling", None) or {}),
        control_plane_endpoints=getattr(args, "control_plane_endpoint", None) or (),
        engine_id=engine_id,
        control_plane_public_key=getattr(args, "control_plane_public_key", None),
        snapshot_timeout_s=getattr(
            args, "control_plane_snapshot_timeout", DEFAULT_SNAPSHOT_TIMEOUT_S
        ),
        metrics_max_users=getattr(args, "output_rate_metrics_users", DEFAULT_MAX_USERS),
        metrics_idle_s=getattr(args, "output_rate_metrics_idle_seconds", DEFAULT_IDLE_S),
        state_dir=getattr(args, "output_rate_state_dir", None) or default_state_dir(),
    )


def identity_from_args(args: argparse.Namespace, rate_config: OutputRateConfig) -> IdentityConfig:
    """The identity settings, or ValueError naming the flag that cannot be."""
    mode = getattr(args, "output_rate_identity", "body")
    header = getattr(args, "output_rate_identity_header", None)
    missing = getattr(args, "output_rate_identity_missing", None)
    flag, header_flag = FLAGS["output_rate_identity"], FLAGS["output_rate_identity_header"]
    missing_flag = FLAGS["output_rate_identity_missing"]
    if mode != "header" and header is not None:
        raise ValueError(f"{header_flag} is only used with {flag} header")
    if mode != "header" and missing is not None:
        raise ValueError(f"{missing_flag} is only used with {flag} header")
    # IdentityConfig field -> the flag's dest
    guard_flags = {
        "header_timeout_s": "output_rate_http_header_timeout",
        "idle_timeout_s": "output_rate_http_idle_timeout",
    }
    guard = {
        field: getattr(args, dest)
        for field, dest in guard_flags.items()
        if getattr(args, dest, None) is not None
    }
    if mode == "body":
        if guard:
            given = FLAGS[guard_flags[next(iter(guard))]]
            raise ValueError(f"{given} is only used with {flag} header or api-key")
        return IdentityConfig()
    if not rate_config.enabled:
        raise ValueError(
            f"{flag} {mode} identifies users for per-user limits, which are off: give "
            "--default-user-output-tokens-per-second, --user-output-tokens-per-second or "
            "--control-plane-endpoint"
        )
    frontend = vllm_compat.frontend_without_middleware(args)
    if frontend is not None:
        option, serving = frontend
        raise ValueError(
            f"{flag} {mode} cannot run with {option}: requests would come through {serving}, "
            "not vLLM's Python HTTP server, where the identity middleware runs (so every "
            f"caller would name its own user); remove {option} (docs/identity.md)"
        )
    operator_key = os.environ.get(OPERATOR_KEY_ENV)
    if mode == "header":
        if operator_key is not None:
            raise ValueError(
                f"{OPERATOR_KEY_ENV} is only used with {flag} api-key (in header mode the "
                "gateway decides who reaches which route)"
            )
        if header is None:
            raise ValueError(f"{flag} header needs {header_flag} NAME (the header a gateway sets)")
        return IdentityConfig(mode="header", header=header, missing=missing or "refuse", **guard)
    if not rate_config.control_plane_endpoints:
        raise ValueError(
            f"{flag} api-key needs {FLAGS['control_plane_endpoint']} (the keys come from "
            "the control plane)"
        )
    if getattr(args, "api_key", None) or os.environ.get("VLLM_API_KEY"):
        raise ValueError(
            f"{flag} api-key cannot run with vLLM's own --api-key (or VLLM_API_KEY): both read "
            "the Authorization header; the output-rate API keys replace it"
        )
    if (getattr(args, "api_server_count", None) or 1) > 1:
        raise ValueError(
            f"{flag} api-key runs with one API server process (--api-server-count 1): the "
            "control plane holds one key connection per engine"
        )
    served = getattr(args, "served_model_name", None)
    model = served[0] if served else getattr(args, "model", "")
    operator_key_sha256 = (
        None
        if operator_key is None
        else hashlib.sha256(check_operator_key(operator_key)).hexdigest()
    )
    return IdentityConfig(
        mode="api-key",
        control_plane_endpoints=rate_config.control_plane_endpoints,
        engine_id=rate_config.engine_id,
        model=str(model or ""),
        control_plane_public_key=rate_config.control_plane_public_key,
        operator_key_sha256=operator_key_sha256,
        state_dir=rate_config.state_dir,
        **guard,
    )
