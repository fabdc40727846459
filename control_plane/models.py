"""SQLAlchemy 2.0 models. The schema is made only by the Alembic migrations."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal, get_args

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from output_rate_core.ids import (
    MAX_ENGINE_ID_LEN,
    MAX_MODEL_LEN,
    MAX_TIER_NAME_LEN,
    MAX_USER_ID_LEN,
    MAX_VLLM_VERSION_LEN,
)
from output_rate_core.keys import KEY_ID_LEN
from output_rate_core.limits import Enforcement, Scope
from output_rate_core.rates import MAX_RATE, MIN_RATE

# Replica ids (OUTPUT_RATE_REPLICA_ID, default host-pid) as stored in replica_leases.
MAX_REPLICA_ID_LEN = 128

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware timestamps on both backends.

    SQLite has no timestamp type and hands back naive values: store UTC, re-attach UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: use timezone-aware UTC timestamps")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _bytewise(length: int) -> String:
    """Byte-order comparison, so a user-id prefix is one index range on both backends
    (a locale collation on PostgreSQL would reorder punctuation and break `q`)."""
    return String(length).with_variant(String(length, collation="C"), "postgresql")


def _rate_check(column: str) -> str:
    return f"{column} IS NULL OR ({column} >= {MIN_RATE} AND {column} <= {MAX_RATE})"


# A scope column holds one of these; null inherits (output_rate_core.limits).
SCOPES: tuple[str, ...] = get_args(Scope)
SCOPE_LEN = max(len(scope) for scope in SCOPES)


def _scope_check(column: str) -> str:
    values = ", ".join(f"'{scope}'" for scope in SCOPES)
    return f"{column} IS NULL OR {column} IN ({values})"


# An enforcement column holds one of these; null inherits (output_rate_core.limits).
ENFORCEMENTS: tuple[str, ...] = get_args(Enforcement)
ENFORCEMENT_LEN = max(len(mode) for mode in ENFORCEMENTS)


def _enforcement_check(column: str) -> str:
    values = ", ".join(f"'{mode}'" for mode in ENFORCEMENTS)
    return f"{column} IS NULL OR {column} IN ({values})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime()}


def table(model: type[Base]) -> Table:
    """A model's table, for the repositories' Core statements."""
    model_table = model.__table__
    assert isinstance(model_table, Table)
    return model_table


class ConfigState(Base):
    """The single row holding the global config version and the default rate."""

    __tablename__ = "config_state"
    __table_args__ = (
        CheckConstraint("id = 1", name="single_row"),
        CheckConstraint(_rate_check("default_rate"), name="default_rate_range"),
        CheckConstraint(_scope_check("default_scope"), name="default_scope_valid"),
        CheckConstraint(
            _enforcement_check("default_enforcement"), name="default_enforcement_valid"
        ),
        CheckConstraint(_rate_check("default_ceiling"), name="default_ceiling_range"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, default=0)
    default_rate: Mapped[int | None] = mapped_column(Integer, nullable=True)
    default_scope: Mapped[str | None] = mapped_column(String(SCOPE_LEN), nullable=True)
    default_enforcement: Mapped[str | None] = mapped_column(String(ENFORCEMENT_LEN), nullable=True)
    # tokens/s users may borrow up to (null: no borrowing).
    default_ceiling: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Maintained by every user write, so listing 1M users needs no COUNT(*) scan.
    num_users: Mapped[int] = mapped_column(BigInteger, default=0)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Tier(Base):
    __tablename__ = "tiers"
    __table_args__ = (
        CheckConstraint(_rate_check("rate"), name="rate_range"),
        CheckConstraint(_scope_check("scope"), name="scope_valid"),
        CheckConstraint(_enforcement_check("enforcement"), name="enforcement_valid"),
        CheckConstraint(_rate_check("ceiling"), name="ceiling_range"),
    )

    name: Mapped[str] = mapped_column(_bytewise(MAX_TIER_NAME_LEN), primary_key=True)
    rate: Mapped[int | None] = mapped_column(Integer, nullable=True)
    scope: Mapped[str | None] = mapped_column(String(SCOPE_LEN), nullable=True)
    enforcement: Mapped[str | None] = mapped_column(String(ENFORCEMENT_LEN), nullable=True)
    # null: inherit the default's.
    ceiling: Mapped[int | None] = mapped_column(Integer, nullable=True)
    description: Mapped[str] = mapped_column(Text, default="")
    version: Mapped[int] = mapped_column(Integer)
    # Users assigned to the tier; maintained with every user write (see num_users above).
    num_users: Mapped[int] = mapped_column(BigInteger, default=0)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class UserLimit(Base):
    """A configured user: its tier and/or its own override rate, scope, enforcement and
    ceiling."""

    __tablename__ = "user_limits"
    __table_args__ = (
        CheckConstraint(_rate_check("rate"), name="rate_range"),
        CheckConstraint(_scope_check("scope"), name="scope_valid"),
        CheckConstraint(_enforcement_check("enforcement"), name="enforcement_valid"),
        CheckConstraint(_rate_check("ceiling"), name="ceiling_range"),
        # Filter by tier, ordered by user: one index range for GET /limits?tier=.
        Index("ix_user_limits_tier_user", "tier", "user"),
    )

    user: Mapped[str] = mapped_column(_bytewise(MAX_USER_ID_LEN), primary_key=True)
    tier: Mapped[str | None] = mapped_column(
        _bytewise(MAX_TIER_NAME_LEN), ForeignKey("tiers.name"), nullable=True
    )
    rate: Mapped[int | None] = mapped_column(Integer, nullable=True)
    scope: Mapped[str | None] = mapped_column(String(SCOPE_LEN), nullable=True)
    enforcement: Mapped[str | None] = mapped_column(String(ENFORCEMENT_LEN), nullable=True)
    # null: inherit (the tier's, else the default's).
    ceiling: Mapped[int | None] = mapped_column(Integer, nullable=True)
    version: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ConfigChange(Base):
    """One row per config version: the ops that turn version-1 into version."""

    __tablename__ = "config_changes"

    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    ops: Mapped[list[dict[str, Any]]] = mapped_column(JSON)


# What an audit entry is about (control_plane/audit/targets.py), each kind its own
# namespace of ids. user: a user's record or its API keys (id: the user); tier: a tier
# (its name); default: the default limit (id "default"); token: a viewer token (its id);
# bulk: one bulk change of many users (id: "<n> users", a label; its before/after map
# each user to its record, and each user's pair is also an audit_targets row).
TargetKind = Literal["user", "tier", "default", "token", "bulk"]
TARGET_KINDS: tuple[str, ...] = get_args(TargetKind)
TARGET_KIND_LEN = max(len(kind) for kind in TARGET_KINDS)


def _target_kind_check(column: str) -> str:
    values = ", ".join(f"'{kind}'" for kind in TARGET_KINDS)
    return f"{column} IN ({values})"


class AuditEntry(Base):
    """One change: what it is about is (target_kind, target), control_plane/audit/targets.py."""

    __tablename__ = "audit_log"
    __table_args__ = (
        CheckConstraint(_target_kind_check("target_kind"), name="target_kind_valid"),
        # A target's entries, and a kind's, newest first: one index range each for
        # GET /audit?target= and ?target_kind=.
        Index("ix_audit_log_target_kind_target_id", "target_kind", "target", "id"),
        Index("ix_audit_log_target_kind_id", "target_kind", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    version: Mapped[int] = mapped_column(Integer)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64))
    target_kind: Mapped[str] = mapped_column(String(TARGET_KIND_LEN))
    target: Mapped[str] = mapped_column(String(MAX_USER_ID_LEN + 16))
    before: Mapped[Any] = mapped_column(JSON, nullable=True)
    after: Mapped[Any] = mapped_column(JSON, nullable=True)


class AuditUser(Base):
    """A user that a bulk entry changed and its record before and after, written with the
    entry: a user's history finds the bulk changes that touched it, and what each did to
    it, by this primary key, without reading the entries' JSON of every user."""

    __tablename__ = "audit_targets"
    # SQLite: the rows are their primary key's B-tree (no second tree to write per user).
    __table_args__ = {"sqlite_with_rowid": False}

    user: Mapped[str] = mapped_column(_bytewise(MAX_USER_ID_LEN), primary_key=True)
    audit_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("audit_log.id"), primary_key=True, autoincrement=False
    )
    # {"before": record, "after": record}: one JSON value per row (half the encoding).
    change: Mapped[dict[str, Any]] = mapped_column(JSON)


class ViewerToken(Base):
    """A read-only API token; only its SHA-256 is stored."""

    __tablename__ = "viewer_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class ApiKey(Base):
    """A live API key of a user (output_rate_core/keys.py): only its SHA-256 is stored.
    Revoking deletes the row; the audit log keeps the record."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(KEY_ID_LEN), primary_key=True)
    user: Mapped[str] = mapped_column(_bytewise(MAX_USER_ID_LEN), index=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # Reported by engines' API servers, written at most once a minute per key.
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class Engine(Base):
    """An engine that connected to the push endpoint, as last seen."""

    __tablename__ = "engines"

    engine_id: Mapped[str] = mapped_column(String(MAX_ENGINE_ID_LEN), primary_key=True)
    model: Mapped[str] = mapped_column(String(MAX_MODEL_LEN), default="")
    # The vLLM the engine core said it runs (null: not said, an engine from before HELLO
    # carried it).
    vllm_version: Mapped[str | None] = mapped_column(String(MAX_VLLM_VERSION_LEN), nullable=True)
    applied_version: Mapped[int] = mapped_column(Integer, default=0)
    connected: Mapped[bool] = mapped_column(default=False)
    # What the engine's API server (push role "api") applied while it is connected
    # (null: none is). The other columns are the engine core's.
    api_applied_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    first_seen: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # The replica holding the engine core's connection, and when it last heard the core
    # (database time): an engine id live on one replica cannot be bound on another.
    home_replica: Mapped[str | None] = mapped_column(String(MAX_REPLICA_ID_LEN), nullable=True)
    home_seen_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # The same for the engine's API server (role "api"): bound on one replica at a time.
    api_home_replica: Mapped[str | None] = mapped_column(String(MAX_REPLICA_ID_LEN), nullable=True)
    api_home_seen_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class UsageMinute(Base):
    """What engines reported for one user in one minute (GET /usage/history).

    Written by control_plane/usage/history.py; rows older than the retention
    (OUTPUT_RATE_USAGE_RETENTION_DAYS) are pruned."""

    __tablename__ = "usage_minutes"
    __table_args__ = (Index("ix_usage_minutes_minute", "minute"),)

    user: Mapped[str] = mapped_column(_bytewise(MAX_USER_ID_LEN), primary_key=True)
    # Unix time (seconds) of the minute's start, as the control plane received the reports.
    minute: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    # Output tokens granted, request-steps refused a token, request-steps a shadow limit
    # would have refused (summed over engines).
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    throttled: Mapped[int] = mapped_column(BigInteger, default=0)
    would_throttle: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # The user's effective limit when the minute was last written (null: unlimited).
    limit_rate: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Seconds the reports covered (a user on two engines at once counts each second
    # once); of them, the seconds a limit was in force; the sum over those seconds of the
    # limit (fleet scope: once per second; engine scope: once per engine); and the tokens
    # granted in them. The limit in force is limit_weight / limited_seconds.
    reported_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    limited_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    limit_weight: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    limited_tokens: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    # Of the tokens, those lent beyond the user's rate (borrowed up to its ceiling).
    borrowed: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class ReplicaLease(Base):
    """Work that runs once for the fleet (docs/replicas.md): which replica holds it, until
    when (database time), and the fencing token that grows with every change of holder."""

    __tablename__ = "replica_leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(MAX_REPLICA_ID_LEN), default="")
    token: Mapped[int] = mapped_column(BigInteger, default=0)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())


# What a fleet_relay row carries: engines' frames to the leader, or the leader's to a home.
RELAY_KINDS = ("up", "down")


class FleetRelayRow(Base):
    """A batch of fleet frames between replicas (control_plane/replicas/relay.py): "up" from
    an engine's home replica to whichever replica leads, "down" from the leader (its fencing
    token) to one home replica. Consumers delete what they read; a sweep prunes the rest."""

    __tablename__ = "fleet_relay"
    __table_args__ = (
        CheckConstraint("kind IN ('up', 'down')", name="kind_valid"),
        Index("ix_fleet_relay_kind_to_replica", "kind", "to_replica"),
        Index("ix_fleet_relay_created_at", "created_at"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), Identity(), primary_key=True
    )
    kind: Mapped[str] = mapped_column(String(4))
    # The leader's fencing token ("down"), or 0.
    token: Mapped[int] = mapped_column(BigInteger, default=0)
    from_replica: Mapped[str] = mapped_column(String(MAX_REPLICA_ID_LEN))
    # The home replica a "down" batch is for ("" for "up": whoever leads).
    to_replica: Mapped[str] = mapped_column(String(MAX_REPLICA_ID_LEN), default="")
    body: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class LiveUsageRow(Base):
    """One replica's live usage window of one of its engines (control_plane/replicas/
    live_usage.py): the engine's recent reports, rewritten about once a second, read by the
    other replicas while fresh. Rows of engines it no longer holds go at its next write;
    any replica prunes rows nobody rewrote."""

    __tablename__ = "live_usage"
    __table_args__ = (Index("ix_live_usage_updated_at", "updated_at"),)

    replica: Mapped[str] = mapped_column(String(MAX_REPLICA_ID_LEN), primary_key=True)
    engine_id: Mapped[str] = mapped_column(String(MAX_ENGINE_ID_LEN), primary_key=True)
    body: Mapped[bytes] = mapped_column(LargeBinary)
    # Database time of the write: readers take rows fresher than a few seconds.
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class FleetSharesRow(Base):
    """The fleet shares as the leader holding ``token`` decided them (control_plane/
    replicas/live_usage.py), rewritten about once a second under its fence: what followers
    show in GET /limits/{user} and GET /engines. Only the current token's row is read."""

    __tablename__ = "fleet_shares"

    token: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    holder: Mapped[str] = mapped_column(String(MAX_REPLICA_ID_LEN))
    body: Mapped[bytes] = mapped_column(LargeBinary)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
