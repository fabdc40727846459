"""Audit queries: entries are added by the services that change something."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Row, insert, select

from control_plane.models import AuditEntry, table

audit_log = table(AuditEntry)

_INSERT_AUDIT = insert(audit_log)


def add_audit(
    conn: Connection,
    *,
    version: int,
    actor: str,
    action: str,
    target: str,
    before: Any,
    after: Any,
) -> None:
    conn.execute(
        _INSERT_AUDIT,
        {
            "at": datetime.now(UTC),
            "version": version,
            "actor": actor,
            "action": action,
            "target": target,
            "before": before,
            "after": after,
        },
    )


def list_audit(
    conn: Connection, *, limit: int, before_id: int | None = None, target: str | None = None
) -> Sequence[Row[Any]]:
    query = select(audit_log).order_by(audit_log.c.id.desc()).limit(limit)
    if before_id is not None:
        query = query.where(audit_log.c.id < before_id)
    if target is not None:
        query = query.where(audit_log.c.target == target)
    return conn.execute(query).all()


def get_audit(conn: Connection, entry_id: int) -> Row[Any] | None:
    return conn.execute(select(audit_log).where(audit_log.c.id == entry_id)).first()
