"""What an audit entry is about: a kind and an id within that kind, so that a user named
`default`, `pro`, `token:1` or `2 users` is never mistaken for the default, a tier, a
token or a bulk change (each kind is its own namespace)."""

from __future__ import annotations

from dataclasses import dataclass

from control_plane.models import TargetKind

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
