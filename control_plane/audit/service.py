"""The audit log: entries written by the services that change something, read a page
at a time."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Connection

from control_plane.audit import repository as repo
from control_plane.audit.schemas import AuditChange, AuditChanges, AuditList, AuditOut
from control_plane.db import service
from control_plane.errors import NotFound

# GET /audit: a page is at most about this big; larger before/after are paged apart.
MAX_AUDIT_PAGE_BYTES = 1024 * 1024
MAX_AUDIT_INLINE_BYTES = 64 * 1024


def record(
    conn: Connection,
    *,
    version: int,
    actor: str,
    action: str,
    target: str,
    before: Any,
    after: Any,
) -> None:
    """One entry, in the caller's transaction (the change it describes)."""
    repo.add_audit(
        conn,
        version=version,
        actor=actor,
        action=action,
        target=target,
        before=before,
        after=after,
    )


def _json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")))


@service("scan")
def list_audit(
    conn: Connection, *, limit: int, before_id: int | None = None, target: str | None = None
) -> AuditList:
    """Newest first, at most `limit` entries and about MAX_AUDIT_PAGE_BYTES (at least one
    entry), optionally only those about `target`. An entry whose before/after are over
    MAX_AUDIT_INLINE_BYTES (a large bulk change) comes with `truncated: true` and null
    before/after: read them page by page with `audit_changes`. `next_before_id` continues
    the listing (null: the end)."""
    items: list[AuditOut] = []
    size = 0
    rows = repo.list_audit(conn, limit=limit, before_id=before_id, target=target)
    for e in rows:
        entry_size = _json_size(e.before) + _json_size(e.after)
        truncated = entry_size > MAX_AUDIT_INLINE_BYTES
        if items and size + min(entry_size, MAX_AUDIT_INLINE_BYTES) > MAX_AUDIT_PAGE_BYTES:
            break
        size += min(entry_size, MAX_AUDIT_INLINE_BYTES)
        items.append(
            AuditOut(
                id=e.id,
                at=e.at,
                version=e.version,
                actor=e.actor,
                action=e.action,
                target=e.target,
                before=None if truncated else e.before,
                after=None if truncated else e.after,
                truncated=truncated,
            )
        )
    more = len(items) < len(rows) or len(rows) == limit
    return AuditList(items=items, next_before_id=items[-1].id if items and more else None)


@service("scan")
def audit_changes(
    conn: Connection, *, entry_id: int, after: str | None, limit: int
) -> AuditChanges:
    """One audit entry's before/after, per target, in target order, a page at a time.

    A bulk entry's before/after map each user to its record; any other entry is one
    item for its target. `next_after` continues (null: the end)."""
    e = repo.get_audit(conn, entry_id)
    if e is None:
        raise NotFound(f"audit entry {entry_id} does not exist", field="entry_id")
    if e.action == "bulk_put_limits" and isinstance(e.after, dict):
        before = e.before if isinstance(e.before, dict) else {}
        targets = sorted(set(before) | set(e.after))
        changes = [(t, before.get(t), e.after.get(t)) for t in targets]
    else:
        changes = [(e.target, e.before, e.after)]
    if after is not None:
        changes = [c for c in changes if c[0] > after]
    page = changes[:limit]
    return AuditChanges(
        id=e.id,
        version=e.version,
        action=e.action,
        items=[AuditChange(target=t, before=b, after=a) for t, b, a in page],
        next_after=page[-1][0] if len(changes) > limit else None,
    )
