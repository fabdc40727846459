"""The audit log: entries written by the services that change something, read a page
at a time."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Row

from control_plane.audit import repository as repo
from control_plane.audit.schemas import AuditChange, AuditChanges, AuditList, AuditOut
from control_plane.audit.targets import DEFAULT_ID, AuditTarget, TargetKind
from control_plane.db import service
from control_plane.errors import InvalidInput, NotFound
from output_rate_core.ids import TIER_NAME_PATTERN

# GET /audit: a page is at most about this big; larger before/after are paged apart
# (sizes: characters of the stored JSON text).
MAX_AUDIT_PAGE_BYTES = 1024 * 1024
MAX_AUDIT_INLINE_BYTES = 64 * 1024


@dataclass(frozen=True)
class Entry:
    """One entry as the service that made the change gives it: who, what, about what,
    and the target's values before and after (None: it did not exist, or no longer does)."""

    actor: str
    action: str
    target: AuditTarget
    before: Any
    after: Any


def record(conn: Connection, *, version: int, entry: Entry) -> None:
    """Write `entry` at `version`, in the caller's transaction (the change it describes); a
    bulk target's users are written with it (audit_targets), so each user's history finds
    it."""
    repo.add_audit(
        conn,
        version=version,
        actor=entry.actor,
        action=entry.action,
        target=entry.target,
        before=entry.before,
        after=entry.after,
    )


def last_version(conn: Connection, target: AuditTarget) -> int | None:
    """The config version that last changed `target` (None: nothing did yet): every
    change is recorded with its version, in its own transaction."""
    return repo.last_version(conn, target)


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
    A bulk entry listed for a user carries what it did to that user (`change`).
    `next_before_id` continues the listing (null: the end).

    The page is cut by the entries' stored sizes, so only the before/after it inlines are
    read (a 10,000-user bulk entry's are ~1 MB)."""
    _check_target(kind, target)
    # One more than the page: whether anything older is left.
    ids = _page_ids(conn, limit=limit + 1, before_id=before_id, kind=kind, target=target)
    older_left = len(ids) > limit
    ids = ids[:limit]
    heads: list[Row[Any]] = []
    size = 0
    for head in repo.get_heads(conn, ids):
        entry_size = min(head.size, MAX_AUDIT_INLINE_BYTES)
        if heads and size + entry_size > MAX_AUDIT_PAGE_BYTES:
            break
        size += entry_size
        heads.append(head)
    inline = [e.id for e in heads if e.size <= MAX_AUDIT_INLINE_BYTES]
    bodies = repo.get_bodies(conn, inline) if inline else {}
    user = target if kind in (None, "bulk") else None
    bulk_ids = [e.id for e in heads if e.target_kind == "bulk"]
    changes = repo.get_user_changes(conn, user, bulk_ids) if user and bulk_ids else {}
    items = []
    for e in heads:
        before, after = bodies.get(e.id, (None, None))
        change = changes.get(e.id)
        items.append(
            AuditOut(
                id=e.id,
                at=e.at,
                version=e.version,
                actor=e.actor,
                action=e.action,
                target_kind=e.target_kind,
                target=e.target,
                before=before,
                after=after,
                truncated=e.id not in bodies,
                change=AuditChange(target=user, before=change[0], after=change[1])
                if user and change
                else None,
            )
        )
    more = len(items) < len(ids) or older_left
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
