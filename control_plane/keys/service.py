"""The rules of API keys. Keys are versioned configuration: a creation appends one
version with `[SetKey]`, a revocation one with `[DeleteKey]`, through the config log
(control_plane/config/), so the push server delivers them as deltas at once; each is
audited (id, prefix and user, never the key nor its hash).

Revoking deletes the row (the audit log keeps who made and revoked which key), so a
user's rows are exactly its live keys."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from sqlalchemy import Connection

from control_plane.audit import service as audit
from control_plane.audit.targets import user_target
from control_plane.config import service as config
from control_plane.db import ConfigChange, service
from control_plane.deps import KeyCreations
from control_plane.errors import Conflict, NotFound, TooManyRequests
from control_plane.keys import repository as repo
from control_plane.keys.schemas import KeyCreated, KeyList, KeyOut
from output_rate_core import keys
from output_rate_core import protocol as p

# A fresh id that is already taken (60 random bits: practically never) is drawn again.
MAX_ID_DRAWS = 8


def _audit_record(key_id: str, user: str) -> dict[str, str]:
    """What the audit log keeps of a key: never the key nor its hash."""
    return {"id": key_id, "prefix": keys.display_prefix(key_id), "user": user}


@service("write")
def create_key(
    conn: Connection, *, actor: str, user: str, max_keys_per_user: int, bucket: KeyCreations
) -> ConfigChange[KeyCreated]:
    """A new key of `user`; the response is the only place the key itself ever shows."""
    state = config.lock(conn)
    num_keys = repo.count_user_keys(conn, user)
    if num_keys >= max_keys_per_user:
        raise Conflict(
            f"user: {user!r} already has {num_keys} API keys, the most one user may hold "
            "(OUTPUT_RATE_MAX_KEYS_PER_USER); revoke one first",
            field="user",
        )
    wait_s = bucket.take()
    if wait_s:
        raise TooManyRequests(
            "API keys are being created faster than this control plane admits "
            "(OUTPUT_RATE_KEY_CREATIONS_PER_MINUTE, _KEY_CREATION_BURST); retry later",
            retry_after_s=wait_s,
        )
    for _ in range(MAX_ID_DRAWS):
        key_id, key = keys.new_key()
        if repo.get_key(conn, key_id) is None:
            break
    else:
        raise RuntimeError("no free API key id")
    key_hash = keys.hash_key(key)
    created_at = datetime.now(UTC)
    commit = config.commit(
        conn,
        state,
        [p.SetKey(id=key_id, user=user, hash=key_hash)],
        audit.Entry(actor, "create_key", user_target(user), None, _audit_record(key_id, user)),
    )
    repo.insert_key(conn, key_id=key_id, user=user, key_hash=key_hash, created_at=created_at)
    return ConfigChange(KeyCreated(id=key_id, key=key, user=user, created_at=created_at), commit)


@service("read")
def list_keys(conn: Connection, *, user: str) -> KeyList:
    """The user's live keys, oldest first (a user with none: an empty list)."""
    return KeyList(
        items=[
            KeyOut(
                id=row.id,
                prefix=keys.display_prefix(row.id),
                created_at=row.created_at,
                last_used_at=row.last_used_at,
            )
            for row in repo.list_user_keys(conn, user)
        ]
    )


@service("write")
def revoke_key(conn: Connection, *, actor: str, key_id: str) -> ConfigChange[None]:
    """Revoke a key on every engine's API server (a delta, like a limit change)."""
    state = config.lock(conn)
    row = repo.get_key(conn, key_id)
    if row is None:
        raise NotFound(f"id: API key {key_id!r} does not exist (or was revoked)", field="id")
    commit = config.commit(
        conn,
        state,
        [p.DeleteKey(id=key_id)],
        audit.Entry(
            actor, "revoke_key", user_target(row.user), _audit_record(row.id, row.user), None
        ),
    )
    repo.delete_key(conn, key_id)
    return ConfigChange(None, commit)


@service("read")
def load_key_snapshot(conn: Connection) -> p.Snapshot:
    """The version and every live key as of one instant, as an engine's API server
    receives them: no limits (those are the engine core's). Like config.load_snapshot,
    one REPEATABLE READ transaction on PostgreSQL: give it a fresh connection."""
    if not conn.in_transaction() and conn.dialect.name == "postgresql":
        conn.execution_options(isolation_level="REPEATABLE READ")
    version = config.current_version(conn)
    return p.Snapshot(
        version=version, default_rate=None, tiers={}, users={}, keys=repo.all_keys(conn)
    )


@service("write_batch")
def record_key_uses(conn: Connection, *, used: Sequence[tuple[str, datetime]]) -> None:
    """last_used_at of existing keys (key id, when), moved forward only; unknown ids
    are ignored (a report never makes a row)."""
    repo.touch_keys(conn, used)
