"""Audit queries: entries are added by the services that change something."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Row, insert, select

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
    """The entry and, for a bulk change, one audit_targets row per user (one executemany)."""
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
    if target.users:
        assert result.inserted_primary_key is not None
        audit_id = result.inserted_primary_key[0]
        conn.execute(_INSERT_AUDIT_USER, [{"user": u, "audit_id": audit_id} for u in target.users])


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


def get_audits(conn: Connection, ids: Sequence[int]) -> list[Row[Any]]:
    """The entries with these ids, in the order given."""
    rows = {r.id: r for r in conn.execute(select(audit_log).where(audit_log.c.id.in_(ids)))}
    return [rows[i] for i in ids]


def get_audit(conn: Connection, entry_id: int) -> Row[Any] | None:
    return conn.execute(select(audit_log).where(audit_log.c.id == entry_id)).first()
