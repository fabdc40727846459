"""The API keys an engine's API server knows, as the control plane's snapshot and key
ops build them (docs/identity.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from output_rate_core import keys
from output_rate_core import protocol as p


@dataclass
class KeyTable:
    # key id -> (user, hash of the key)
    keys: dict[str, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def from_snapshot(cls, snapshot: p.Snapshot) -> KeyTable:
        return cls(dict(snapshot.keys))

    def apply(self, op: p.Op) -> bool:
        """Apply a key op (True); limit ops change nothing here (False)."""
        if isinstance(op, p.SetKey):
            self.keys[op.id] = (op.user, op.hash)
            return True
        if isinstance(op, p.DeleteKey):
            self.keys.pop(op.id, None)
            return True
        return False

    def user_of(self, key: str) -> tuple[str, str] | None:
        """(key id, user) of a presented key, or None: not a key, unknown or revoked."""
        key_id = keys.key_id_of(key)
        if key_id is None:
            return None
        record = self.keys.get(key_id)
        if not keys.matches(key, None if record is None else record[1]):
            return None
        assert record is not None
        return key_id, record[0]
