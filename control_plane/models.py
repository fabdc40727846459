"""SQLAlchemy 2.0 models. The schema is made only by the Alembic migrations."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, DateTime, ForeignKey, Integer, MetaData, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
MAX_USER_ID_LEN = 256
MAX_TIER_NAME_LEN = 64


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class ConfigState(Base):
    """The single row holding the global config version and the default rate."""

    __tablename__ = "config_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, default=0)
    default_rate: Mapped[int | None] = mapped_column(Integer, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Tier(Base):
    __tablename__ = "tiers"

    name: Mapped[str] = mapped_column(String(MAX_TIER_NAME_LEN), primary_key=True)
    rate: Mapped[int | None] = mapped_column(Integer, nullable=True)
    description: Mapped[str] = mapped_column(Text, default="")
    version: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class UserLimit(Base):
    """A configured user: its tier and/or its own override rate."""

    __tablename__ = "user_limits"

    user: Mapped[str] = mapped_column(String(MAX_USER_ID_LEN), primary_key=True)
    tier: Mapped[str | None] = mapped_column(ForeignKey("tiers.name"), nullable=True, index=True)
    rate: Mapped[int | None] = mapped_column(Integer, nullable=True)
    version: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ConfigChange(Base):
    """One row per config version: the ops that turn version-1 into version."""

    __tablename__ = "config_changes"

    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    ops: Mapped[list[dict[str, Any]]] = mapped_column(JSON)


class AuditEntry(Base):
    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    version: Mapped[int] = mapped_column(Integer)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(MAX_USER_ID_LEN + 16))
    before: Mapped[Any] = mapped_column(JSON, nullable=True)
    after: Mapped[Any] = mapped_column(JSON, nullable=True)


class ViewerToken(Base):
    """A read-only API token; only its SHA-256 is stored."""

    __tablename__ = "viewer_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Engine(Base):
    """An engine that connected to the push endpoint, as last seen."""

    __tablename__ = "engines"

    engine_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    model: Mapped[str] = mapped_column(String(512), default="")
    applied_version: Mapped[int] = mapped_column(Integer, default=0)
    connected: Mapped[bool] = mapped_column(default=False)
    first_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
