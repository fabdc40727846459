"""What an audit entry is about: a kind and an id within that kind, so that a user named
`default`, `pro`, `token:1` or `2 users` is never mistaken for the default, a tier, a
token or a bulk change (each kind is its own namespace)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# user: a user's record or its API keys (id: the user); tier: a tier (its name); default:
# the default limit (id "default"); token: a viewer token (its id); bulk: one bulk change
# of many users (id: "<n> users", a label; its before/after map each user to its record,
# and each user's pair is also an audit_targets row).
TargetKind = Literal["user", "tier", "default", "token", "bulk"]
TARGET_KINDS: tuple[str, ...] = get_args(TargetKind)
TARGET_KIND_LEN = max(len(kind) for kind in TARGET_KINDS)
DEFAULT_ID = "default"


@dataclass(frozen=True)
class AuditTarget:
    kind: TargetKind
    id: str


def user_target(user: str) -> AuditTarget:
    return AuditTarget("user", user)


def tier_target(name: str) -> AuditTarget:
    return AuditTarget("tier", name)


DEFAULT_TARGET = AuditTarget("default", DEFAULT_ID)


def token_target(token_id: int) -> AuditTarget:
    return AuditTarget("token", str(token_id))


def bulk_target(num_users: int) -> AuditTarget:
    return AuditTarget("bulk", f"{num_users} users")
