"""Audit queries: entries are added by the services that change something."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Row, Select, Text, cast, func, insert, select

from control_plane.audit.targets import AuditTarget, TargetKind
from control_plane.models import AuditEntry, AuditUser, table

audit_log = table(AuditEntry)
audit_targets = table(AuditUser)

_INSERT_AUDIT = insert(audit_log)
_INSERT_AUDIT_USER = insert(audit_targets)


def add_audit(
    conn: Connection,
    *,
    version: int,
    actor: str,
    action: str,
    target: AuditTarget,
    before: Any,
    after: Any,
) -> None:
    result = conn.execute(
        _INSERT_AUDIT,
        {
            "at": datetime.now(UTC),
            "version": version,
            "actor": actor,
            "action": action,
            "target_kind": target.kind,
            "target": target.id,
            "before": before,
            "after": after,
        },
    )
    if target.kind == "bulk":
        assert result.inserted_primary_key is not None
        _add_bulk_users(conn, result.inserted_primary_key[0], before, after)


def _add_bulk_users(conn: Connection, audit_id: int, before: Any, after: Any) -> None:
    """One audit_targets row per user of a bulk entry's before/after maps (user -> its
    record), with its record on each side: one executemany."""
    before_, after_ = (side if isinstance(side, dict) else {} for side in (before, after))
    rows = [
        {
            "user": u,
            "audit_id": audit_id,
            "change": {"before": before_.get(u), "after": after_.get(u)},
        }
        for u in before_.keys() | after_.keys()
    ]
    if rows:
        conn.execute(_INSERT_AUDIT_USER, rows)


def entry_ids(
    conn: Connection,
    *,
    limit: int,
    before_id: int | None,
    kind: TargetKind | None,
    target: str | None,
) -> list[int]:
    """Ids of the newest `limit` entries below `before_id` of `kind` about `target` (None:
    any), newest first: one range of ix_audit_log_target_kind_target_id (or the key)."""
    query = select(audit_log.c.id)
    if kind is not None:
        query = query.where(audit_log.c.target_kind == kind)
    if target is not None:
        query = query.where(audit_log.c.target == target)
    if before_id is not None:
        query = query.where(audit_log.c.id < before_id)
    return list(conn.execute(query.order_by(audit_log.c.id.desc()).limit(limit)).scalars())


def last_version(conn: Connection, target: AuditTarget) -> int | None:
    """The config version of the newest entry about `target` (None: none): one probe of
    ix_audit_log_target_kind_target_id."""
    query = (
        select(audit_log.c.version)
        .where(audit_log.c.target_kind == target.kind, audit_log.c.target == target.id)
        .order_by(audit_log.c.id.desc())
        .limit(1)
    )
    return conn.execute(query).scalar()


def bulk_ids_of_user(
    conn: Connection, *, limit: int, before_id: int | None, user: str
) -> list[int]:
    """Ids of the newest `limit` bulk entries below `before_id` that changed `user`,
    newest first: one range of audit_targets' primary key."""
    query = select(audit_targets.c.audit_id).where(audit_targets.c.user == user)
    if before_id is not None:
        query = query.where(audit_targets.c.audit_id < before_id)
    return list(
        conn.execute(query.order_by(audit_targets.c.audit_id.desc()).limit(limit)).scalars()
    )


# An entry's before/after as stored (the JSON text), read without loading them.
_STORED_SIZE = {
    side: func.coalesce(func.length(cast(audit_log.c[side], Text)), len("null"))
    for side in ("before", "after")
}
_HEAD_COLUMNS = [c for c in audit_log.c if c.name not in _STORED_SIZE]


def get_heads(conn: Connection, ids: Sequence[int]) -> list[Row[Any]]:
    """The entries with these ids, in the order given, without before/after: their
    stored size instead (`size`, characters of JSON text)."""
    size = (_STORED_SIZE["before"] + _STORED_SIZE["after"]).label("size")
    query: Select[Any] = select(*_HEAD_COLUMNS, size).where(audit_log.c.id.in_(ids))
    rows = {r.id: r for r in conn.execute(query)}
    return [rows[i] for i in ids]


def get_bodies(conn: Connection, ids: Sequence[int]) -> dict[int, tuple[Any, Any]]:
    """entry id -> its (before, after)."""
    query = select(audit_log.c.id, audit_log.c.before, audit_log.c.after)
    return {r.id: (r.before, r.after) for r in conn.execute(query.where(audit_log.c.id.in_(ids)))}


def get_user_changes(conn: Connection, user: str, ids: Sequence[int]) -> dict[int, tuple[Any, Any]]:
    """bulk entry id -> what it did to `user`: (before, after), for those that touched it."""
    t = audit_targets.c
    query = select(t.audit_id, t.change).where(t.user == user, t.audit_id.in_(ids))
    return {r.audit_id: (r.change["before"], r.change["after"]) for r in conn.execute(query)}


def get_audit(conn: Connection, entry_id: int) -> Row[Any] | None:
    return conn.execute(select(audit_log).where(audit_log.c.id == entry_id)).first()
