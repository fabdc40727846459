"""The control plane's settings: environment variables prefixed OUTPUT_RATE_, or .env.

Every value is checked here, at startup: a bad one stops `output-rate serve` with a
message naming its variable (docs/control-plane.md, "Settings")."""

from __future__ import annotations

import logging
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from control_plane.curve_keys import AllowList, check_z85_key, parse_allow_list
from control_plane.fleet.allocator import DELIVERY_MARGIN_S, min_gone_after_s
from output_rate_core.http_guard import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_HEAD_BYTES,
    MAX_TIMEOUT_S,
)
from output_rate_core.outage import FRACTION, KEEP, MAX_OUTAGE_KEEP_S, SERVING, OutagePolicy
from output_rate_core.protocol import HEARTBEAT_INTERVAL_S, SERVER_SILENCE_S

logger = logging.getLogger("control_plane")

ENV_PREFIX = "OUTPUT_RATE_"
# Shorter admin tokens are refused; tokens under the recommended length are warned about.
MIN_ADMIN_TOKEN_LEN = 8
RECOMMENDED_ADMIN_TOKEN_LEN = 16
# An engine is shown disconnected after this many heartbeats missed, at the least.
MIN_TIMEOUT_HEARTBEATS = 1.5
DEFAULT_ENGINE_TIMEOUT_S = 5.0
DEFAULT_ENGINE_RETENTION_S = 24 * 3600.0
DEFAULT_SHARE_LEASE_S = 10.0
DEFAULT_HISTORY_MAX_USERS_PER_MINUTE = 5_000


def variable(field: str) -> str:
    return ENV_PREFIX + field.upper()


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_file=".env", extra="ignore")

    database_url: str = "sqlite:///./output_rate.db"
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 8700
    zmq_endpoint: str = "tcp://127.0.0.1:5557"
    admin_token: SecretStr | None = None
    # CURVE keys (Z85) of the push endpoint, from `output-rate keys`; unset = plain TCP.
    # The public key is optional; when given it must be the secret key's.
    zmq_secret_key: SecretStr | None = None
    zmq_public_key: str | None = None
    # Engine keys admitted, each with the engine ids it may claim:
    # KEY=engine-1|engine-1b,KEY2=engine-2 (a bare KEY may claim any id); from
    # `output-rate keys`. Empty = any engine that knows the server's public key.
    zmq_client_keys: str = ""
    # Seconds without a heartbeat before an engine is shown as disconnected.
    engine_timeout_s: float = DEFAULT_ENGINE_TIMEOUT_S
    # Seconds after its last heartbeat an engine is dropped from GET /engines.
    engine_retention_s: float = DEFAULT_ENGINE_RETENTION_S
    # Fleet shares (docs/fleet.md): an engine that hears no renewal for the lease falls
    # back to its safe share; an engine silent for gone_after (default 3 x lease) is
    # dropped from the fleet and its part goes to the others.
    share_lease_s: float = Field(default=DEFAULT_SHARE_LEASE_S, ge=1.0, le=3600.0)
    share_gone_after_s: float | None = Field(default=None, le=86_400.0)
    # What engines do when their lease ends, the control plane gone (docs/fleet.md,
    # "Outage, engine death, partition"): "serving", each user at L / the engines serving
    # it; "keep", the last shares for outage_keep_s more, then as "serving"; "fraction",
    # each user at outage_fraction x L on every engine (the bound traded for service).
    outage_policy: Literal["serving", "keep", "fraction"] = SERVING
    outage_keep_s: float | None = Field(default=None, ge=1.0, le=MAX_OUTAGE_KEEP_S)
    outage_fraction: float | None = Field(default=None, gt=0.0, le=1.0)
    # Days of per-minute usage history kept (GET /usage/history); older minutes are pruned.
    usage_retention_days: int = Field(default=7, ge=1, le=3650)
    # API keys (docs/control-plane.md, "API keys"): live keys one user may hold, and the
    # rate of POST /users/{user}/keys this process admits (a token bucket: this many a
    # minute on average, up to the burst at once).
    max_keys_per_user: int = Field(default=20, ge=1, le=10_000)
    key_creations_per_minute: int = Field(default=60, ge=1, le=1_000_000)
    key_creation_burst: int = Field(default=20, ge=1, le=1_000_000)
    # Seconds between the push thread's reads of the change log: the safety net under the
    # wake-ups (this process's commits; other replicas' through PostgreSQL NOTIFY).
    push_poll_interval_s: float = Field(default=1.0, ge=0.05, le=60.0)
    # PostgreSQL replicas: wake the other replicas with NOTIFY after each config commit and
    # relay batch (docs/replicas.md). Off: they find changes at their next poll only (the
    # change log every push_poll_interval_s, relay rows every 0.25 s).
    replica_notify: bool = True
    # This replica's name in the leader lease and readiness (default: host-pid).
    replica_id: str | None = Field(
        default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@-]+$"
    )
    # Users (rows) the usage history keeps per minute; a report's users beyond are left
    # out and counted. At most 100,000 (a row is ~260 bytes: ~26 MB of history a minute).
    usage_history_max_users_per_minute: int = Field(
        default=DEFAULT_HISTORY_MAX_USERS_PER_MINUTE, ge=1, le=100_000
    )
    # HTTP connections (control_plane/http_server.py, docs/deploy.md): a request head must
    # be complete this long after the connection opened (or after its first byte on a
    # kept-alive connection), and at most this many bytes; a body, or the reading of a
    # response, may pause this long; an idle kept-alive connection is closed after this
    # long (uvicorn's, whole seconds).
    http_header_timeout_s: float = Field(default=DEFAULT_HEADER_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)
    http_max_header_bytes: int = Field(default=DEFAULT_MAX_HEAD_BYTES, ge=1024, le=16 * 2**20)
    http_idle_timeout_s: float = Field(default=DEFAULT_IDLE_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)
    http_keep_alive_timeout_s: int = Field(default=5, ge=1, le=300)
    # Connections served at once; unset: derived from the open-file limit at start.
    http_max_connections: int | None = Field(default=None, ge=1)

    @field_validator("replica_notify", mode="before")
    @classmethod
    def _replica_notify(cls, value: object) -> object:
        # One spelling each way: a typo ("flase", "0ff") must not pass for either.
        if isinstance(value, str):
            if value.strip().lower() not in ("true", "false"):
                raise ValueError(f"{variable('replica_notify')} must be true or false")
            return value.strip().lower() == "true"
        return value

    @field_validator("admin_token")
    @classmethod
    def _admin_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        token = value.get_secret_value()
        name = variable("admin_token")
        if not token.strip():
            raise ValueError(f"{name} is empty: nobody could write (unset it or set a token)")
        if token != token.strip():
            raise ValueError(f"{name} has surrounding spaces, which no client sends (remove them)")
        if len(token) < MIN_ADMIN_TOKEN_LEN:
            raise ValueError(
                f"{name} is {len(token)} characters; at least {MIN_ADMIN_TOKEN_LEN} "
                f"(use e.g. `openssl rand -hex 24`)"
            )
        if len(token) < RECOMMENDED_ADMIN_TOKEN_LEN:
            logger.warning(
                "%s is only %d characters; use at least %d random characters",
                name,
                len(token),
                RECOMMENDED_ADMIN_TOKEN_LEN,
            )
        return value

    @field_validator("zmq_secret_key")
    @classmethod
    def _secret_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            check_z85_key(value.get_secret_value(), variable=variable("zmq_secret_key"))
        return value

    @field_validator("zmq_public_key")
    @classmethod
    def _public_key(cls, value: str | None) -> str | None:
        if value is not None and value != "":
            check_z85_key(value, variable=variable("zmq_public_key"))
        return value or None

    @field_validator("zmq_client_keys")
    @classmethod
    def _client_keys(cls, value: str) -> str:
        parse_allow_list(value, variable=variable("zmq_client_keys"))
        return value

    @field_validator("engine_timeout_s")
    @classmethod
    def _timeout(cls, value: float) -> float:
        least = MIN_TIMEOUT_HEARTBEATS * HEARTBEAT_INTERVAL_S
        if not value >= least:
            raise ValueError(
                f"{variable('engine_timeout_s')}={value} is at or near the "
                f"{HEARTBEAT_INTERVAL_S} s heartbeat: every engine would flap; at least {least}"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        secret = self.zmq_secret_key
        if self.zmq_public_key is not None:
            if secret is None:
                raise ValueError(
                    f"{variable('zmq_public_key')} is set without {variable('zmq_secret_key')}"
                )
            import zmq

            derived = zmq.curve_public(secret.get_secret_value().encode()).decode()
            if derived != self.zmq_public_key:
                raise ValueError(
                    f"{variable('zmq_public_key')} is not the public key of "
                    f"{variable('zmq_secret_key')} (that is {derived}); they are not one pair"
                )
        if self.zmq_client_keys.strip() and secret is None:
            raise ValueError(
                f"{variable('zmq_client_keys')} needs {variable('zmq_secret_key')}: without "
                "CURVE no engine key is checked"
            )
        self._check_outage()
        self._check_timeouts()
        if not self.engine_retention_s >= self.engine_timeout_s:
            raise ValueError(
                f"{variable('engine_retention_s')} must be at least "
                f"{variable('engine_timeout_s')} ({self.engine_timeout_s})"
            )
        return self

    @property
    def outage(self) -> OutagePolicy:
        """The outage policy the settings choose (checked at startup: `_check_outage`)."""
        mode = self.outage_policy
        keep_s, fraction = self.outage_keep_s, self.outage_fraction
        return OutagePolicy(
            mode,
            keep_s if mode == KEEP and keep_s is not None else 0.0,
            fraction if mode == FRACTION and fraction is not None else 0.0,
        )

    def _check_outage(self) -> None:
        """Each outage setting goes with its policy: a keep time or a fraction the policy
        would ignore is refused, and so is a policy missing its own."""
        policy, name = self.outage_policy, variable("outage_policy")
        for field, mode in (("outage_keep_s", KEEP), ("outage_fraction", FRACTION)):
            value = getattr(self, field)
            if policy == mode and value is None:
                raise ValueError(f"{name}={mode} needs {variable(field)}")
            if policy != mode and value is not None:
                raise ValueError(
                    f"{variable(field)} is set but {name} is {policy}: it applies to "
                    f"{name}={mode} only (set that, or unset {variable(field)})"
                )

    def _check_timeouts(self) -> None:
        """The timeouts against each other (docs/fleet.md, "Numbers"; docs/replicas.md,
        "Failover"): each message names both variables and the least value that holds."""
        lease = self.share_lease_s
        kept = self.outage.kept_s
        least_gone = min_gone_after_s(lease, kept)
        if self.share_gone_after_s is not None and self.share_gone_after_s < least_gone:
            keep_term = f" + {variable('outage_keep_s')} ({kept})" if kept else ""
            raise ValueError(
                f"{variable('share_gone_after_s')}={self.share_gone_after_s} is under 2 x "
                f"{variable('share_lease_s')}{keep_term} + {DELIVERY_MARGIN_S} s = "
                f"{least_gone}: an engine cut off one way (it hears renewals, the control "
                "plane hears nothing) would still enforce its share after its part went to "
                f"the others; set it to at least {least_gone} (or unset it: 3 x the lease"
                f"{', at least that' if kept else ''})"
            )
        # An engine that leaves a dead replica keeps its fleet shares until its lease ends:
        # a lease shorter than the failover drops every fleet user to its safe share at
        # every failover.
        failover = SERVER_SILENCE_S + HEARTBEAT_INTERVAL_S + DELIVERY_MARGIN_S
        if lease < failover:
            logger.warning(
                "%s=%s is under the %s s an engine takes to move to another replica: its "
                "fleet users fall back to their safe share at every failover",
                variable("share_lease_s"),
                lease,
                failover,
            )
        # An engine is shown disconnected, and no longer counted in the fleet size, after
        # the engine timeout: longer than gone_after, it counts engines the allocator
        # dropped (safe shares smaller than they need be, never larger: a warning).
        gone = (
            self.share_gone_after_s
            if self.share_gone_after_s is not None
            else max(3 * lease, least_gone)
        )
        if self.engine_timeout_s > gone:
            logger.warning(
                "%s=%s is over %s (%s): engines the fleet dropped still count in every safe "
                "share until then (smaller safe shares than need be)",
                variable("engine_timeout_s"),
                self.engine_timeout_s,
                variable("share_gone_after_s"),
                gone,
            )

    def allowed_engine_keys(self) -> AllowList:
        """OUTPUT_RATE_ZMQ_CLIENT_KEYS parsed: key -> engine ids it may claim (None: any)."""
        return parse_allow_list(self.zmq_client_keys)


def settings_errors(error: Exception) -> list[str]:
    """One line per bad setting (pydantic's ValidationError), naming its variable."""
    from pydantic import ValidationError

    if not isinstance(error, ValidationError):
        return [str(error)]
    lines = []
    for e in error.errors():
        message = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        loc = e.get("loc", ())
        if loc and not message.startswith(ENV_PREFIX):
            message = f"{variable(str(loc[0]))}: {message}"
        lines.append(message)
    return lines
