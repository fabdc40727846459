"""Queries. No rules here: the services decide, this module reads and writes rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from control_plane.models import (
    AuditEntry,
    ConfigChange,
    ConfigState,
    Engine,
    Tier,
    UserLimit,
    ViewerToken,
)

CONFIG_ROW_ID = 1


def lock_config(session: Session) -> ConfigState:
    """Take the writers' lock (a row lock on PostgreSQL, the write lock on SQLite).

    The no-op UPDATE is the first statement of every write transaction, so
    concurrent writers queue here before reading anything they will change.
    """
    session.execute(
        update(ConfigState)
        .where(ConfigState.id == CONFIG_ROW_ID)
        .values(version=ConfigState.version)
    )
    state = session.get(ConfigState, CONFIG_ROW_ID, populate_existing=True)
    assert state is not None, "config_state row is created by the initial migration"
    return state


def get_config(session: Session) -> ConfigState:
    state = session.get(ConfigState, CONFIG_ROW_ID)
    assert state is not None, "config_state row is created by the initial migration"
    return state


def get_tier(session: Session, name: str) -> Tier | None:
    return session.get(Tier, name)


def list_tiers(session: Session) -> Sequence[Tier]:
    return session.scalars(select(Tier).order_by(Tier.name)).all()


def count_users_by_tier(session: Session) -> dict[str, int]:
    rows = session.execute(
        select(UserLimit.tier, func.count())
        .where(UserLimit.tier.is_not(None))
        .group_by(UserLimit.tier)
    )
    return {tier: count for tier, count in rows if tier is not None}


def count_users_in_tier(session: Session, name: str) -> int:
    return int(session.scalar(select(func.count()).where(UserLimit.tier == name)) or 0)


def get_user(session: Session, user: str) -> UserLimit | None:
    return session.get(UserLimit, user)


def get_users(session: Session, users: Sequence[str]) -> dict[str, UserLimit]:
    rows = session.scalars(select(UserLimit).where(UserLimit.user.in_(users)))
    return {row.user: row for row in rows}


def list_users(
    session: Session, *, offset: int, limit: int, tier: str | None, prefix: str | None
) -> tuple[Sequence[UserLimit], int]:
    query = select(UserLimit)
    count_query = select(func.count()).select_from(UserLimit)
    if tier is not None:
        query = query.where(UserLimit.tier == tier)
        count_query = count_query.where(UserLimit.tier == tier)
    if prefix:
        # A range on the primary key instead of LIKE: uses the index on both
        # databases and needs no escaping of % and _.
        upper = prefix + "\U0010ffff"
        query = query.where(UserLimit.user >= prefix, UserLimit.user < upper)
        count_query = count_query.where(UserLimit.user >= prefix, UserLimit.user < upper)
    rows = session.scalars(query.order_by(UserLimit.user).offset(offset).limit(limit)).all()
    total = int(session.scalar(count_query) or 0)
    return rows, total


def add_change(session: Session, *, version: int, ops: list[dict[str, Any]]) -> None:
    session.add(ConfigChange(version=version, ops=ops))


def changes_since(session: Session, version: int) -> Sequence[ConfigChange]:
    return session.scalars(
        select(ConfigChange).where(ConfigChange.version > version).order_by(ConfigChange.version)
    ).all()


def add_audit(
    session: Session,
    *,
    version: int,
    actor: str,
    action: str,
    target: str,
    before: Any,
    after: Any,
) -> None:
    session.add(
        AuditEntry(
            version=version, actor=actor, action=action, target=target, before=before, after=after
        )
    )


def list_audit(session: Session, *, limit: int) -> Sequence[AuditEntry]:
    return session.scalars(select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)).all()


def find_viewer_token(session: Session, token_hash: str) -> ViewerToken | None:
    return session.scalar(
        select(ViewerToken).where(
            ViewerToken.token_hash == token_hash, ViewerToken.revoked_at.is_(None)
        )
    )


def list_viewer_tokens(session: Session) -> Sequence[ViewerToken]:
    return session.scalars(select(ViewerToken).order_by(ViewerToken.id)).all()


def list_engines(session: Session) -> Sequence[Engine]:
    return session.scalars(select(Engine).order_by(Engine.engine_id)).all()
