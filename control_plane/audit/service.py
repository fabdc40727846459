"""The audit log: entries written by the services that change something, read a page
at a time."""

from __future__ import annotations

import json
import re
from typing import Any

from sqlalchemy import Connection

from control_plane.audit import repository as repo
from control_plane.audit.schemas import AuditChange, AuditChanges, AuditList, AuditOut
from control_plane.audit.targets import DEFAULT_ID, AuditTarget, TargetKind
from control_plane.db import service
from control_plane.errors import InvalidInput, NotFound
from output_rate_core.ids import TIER_NAME_PATTERN

# GET /audit: a page is at most about this big; larger before/after are paged apart.
MAX_AUDIT_PAGE_BYTES = 1024 * 1024
MAX_AUDIT_INLINE_BYTES = 64 * 1024
# Entries read per query while a page is filled (a bulk entry's JSON may be ~1 MB).
READ_BATCH = 32


def record(
    conn: Connection,
    *,
    version: int,
    actor: str,
    action: str,
    target: AuditTarget,
    before: Any,
    after: Any,
) -> None:
    """One entry, in the caller's transaction (the change it describes); a bulk target's
    users are written with it (audit_targets), so each user's history finds it."""
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


# kind -> what a `target` of that kind looks like (user and bulk: the route's user-id rule)
_TARGET_RULES = {
    "tier": (re.compile(TIER_NAME_PATTERN), "a tier name"),
    "default": (re.compile(f"^{DEFAULT_ID}$"), f"{DEFAULT_ID!r} (or none)"),
    "token": (re.compile(r"^[1-9][0-9]{0,9}$"), "a token id (a positive integer)"),
}


def _check_target(kind: TargetKind | None, target: str | None) -> None:
    rule = _TARGET_RULES.get(kind or "")
    if rule is not None and target is not None and not rule[0].match(target):
        raise InvalidInput(
            f"target: with target_kind={kind} it must be {rule[1]}, got {target[:40]!r}",
            field="target",
        )


def _page_ids(
    conn: Connection,
    *,
    limit: int,
    before_id: int | None,
    kind: TargetKind | None,
    target: str | None,
) -> list[int]:
    """The ids of the page, newest first. A `target` without a kind is a user: its own
    entries and the bulk changes that touched it; kind `bulk` with a `target`: only those
    bulk changes. Each part is cut to `limit` below `before_id`, so the page is exactly the
    newest `limit` of their union and the next page (below its last id) misses none."""
    if target is not None and kind in (None, "bulk"):
        parts = [repo.bulk_ids_of_user(conn, limit=limit, before_id=before_id, user=target)]
        if kind is None:
            parts.append(
                repo.entry_ids(conn, limit=limit, before_id=before_id, kind="user", target=target)
            )
    else:
        parts = [repo.entry_ids(conn, limit=limit, before_id=before_id, kind=kind, target=target)]
    return sorted({i for part in parts for i in part}, reverse=True)[:limit]


def _user_change(e: Any, user: str) -> AuditChange | None:
    """What a bulk entry did to `user` (None: it did not touch it)."""
    before = e.before if isinstance(e.before, dict) else {}
    after = e.after if isinstance(e.after, dict) else {}
    if user not in before and user not in after:
        return None
    return AuditChange(target=user, before=before.get(user), after=after.get(user))


@service("scan")
def list_audit(
    conn: Connection,
    *,
    limit: int,
    before_id: int | None = None,
    target: str | None = None,
    kind: TargetKind | None = None,
) -> AuditList:
    """Newest first, at most `limit` entries and about MAX_AUDIT_PAGE_BYTES (at least one
    entry), optionally only those of `kind` and about `target` (see `_page_ids`). An entry
    whose before/after are over MAX_AUDIT_INLINE_BYTES (a large bulk change) comes with
    `truncated: true` and null before/after: read them page by page with `audit_changes`.
    A bulk entry listed for a user carries that user's own before/after (`change`).
    `next_before_id` continues the listing (null: the end)."""
    _check_target(kind, target)
    ids = _page_ids(conn, limit=limit, before_id=before_id, kind=kind, target=target)
    user = target if kind in (None, "bulk") else None
    items: list[AuditOut] = []
    size = 0
    full = False
    # Read a few entries at a time: a page stops at its byte bound, often long before
    # `limit` large bulk entries would have been loaded.
    for start in range(0, len(ids), READ_BATCH):
        for e in repo.get_audits(conn, ids[start : start + READ_BATCH]):
            entry_size = _json_size(e.before) + _json_size(e.after)
            truncated = entry_size > MAX_AUDIT_INLINE_BYTES
            if items and size + min(entry_size, MAX_AUDIT_INLINE_BYTES) > MAX_AUDIT_PAGE_BYTES:
                full = True
                break
            size += min(entry_size, MAX_AUDIT_INLINE_BYTES)
            items.append(
                AuditOut(
                    id=e.id,
                    at=e.at,
                    version=e.version,
                    actor=e.actor,
                    action=e.action,
                    target_kind=e.target_kind,
                    target=e.target,
                    before=None if truncated else e.before,
                    after=None if truncated else e.after,
                    truncated=truncated,
                    change=_user_change(e, user) if user and e.target_kind == "bulk" else None,
                )
            )
        if full:
            break
    more = full or len(ids) == limit
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
    if e.target_kind == "bulk" and isinstance(e.after, dict):
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
        target_kind=e.target_kind,
        items=[AuditChange(target=t, before=b, after=a) for t, b, a in page],
        next_after=page[-1][0] if len(changes) > limit else None,
    )
