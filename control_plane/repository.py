"""Queries. No rules here: the services decide, this module reads and writes rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from control_plane.db import begin_write
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
    begin_write(session)
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


def add_tier_users(session: Session, name: str, delta: int) -> None:
    session.execute(update(Tier).where(Tier.name == name).values(num_users=Tier.num_users + delta))


def tier_has_users(session: Session, name: str) -> bool:
    return session.scalar(select(UserLimit.user).where(UserLimit.tier == name).limit(1)) is not None


def get_user(session: Session, user: str) -> UserLimit | None:
    return session.get(UserLimit, user)


# Keeps IN (...) lists below SQLite's bound-parameter limit.
_IN_CHUNK = 500


def get_users(session: Session, users: Sequence[str]) -> dict[str, UserLimit]:
    found: dict[str, UserLimit] = {}
    for start in range(0, len(users), _IN_CHUNK):
        chunk = users[start : start + _IN_CHUNK]
        for row in session.scalars(select(UserLimit).where(UserLimit.user.in_(chunk))):
            found[row.user] = row
    return found


def all_user_records(session: Session) -> dict[str, tuple[str | None, int | None]]:
    rows = session.execute(select(UserLimit.user, UserLimit.tier, UserLimit.rate))
    return {user: (tier, rate) for user, tier, rate in rows}


def prefix_upper_bound(prefix: str) -> str | None:
    """The smallest string above every string that starts with `prefix` (None: unbounded)."""
    chars = list(prefix)
    while chars:
        last = ord(chars[-1])
        if last < 0x10FFFF and not 0xD7FF <= last < 0xDFFF:
            chars[-1] = chr(last + 1)
            return "".join(chars)
        chars.pop()
    return None


def _filter(query: Any, *, tier: str | None, prefix: str | None) -> Any:
    if tier is not None:
        query = query.where(UserLimit.tier == tier)
    if prefix:
        # A range on the (byte-ordered) key instead of LIKE: one index range on both
        # databases, and no escaping of % and _.
        query = query.where(UserLimit.user >= prefix)
        upper = prefix_upper_bound(prefix)
        if upper is not None:
            query = query.where(UserLimit.user < upper)
    return query


def list_users(
    session: Session, *, offset: int, limit: int, tier: str | None, prefix: str | None
) -> Sequence[UserLimit]:
    query = _filter(select(UserLimit), tier=tier, prefix=prefix)
    return session.scalars(query.order_by(UserLimit.user).offset(offset).limit(limit)).all()


def count_users(session: Session, *, tier: str | None, prefix: str | None) -> int:
    query = _filter(select(func.count()).select_from(UserLimit), tier=tier, prefix=prefix)
    return int(session.scalar(query) or 0)


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
