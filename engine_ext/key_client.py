"""The API server's connection to the control plane in ``--output-rate-identity api-key``
mode (docs/identity.md): the API keys of this engine, kept current, and when each was
last used, reported back.

It connects with the engine's id and role "api" and follows the same rules as the
engine core's connection (engine_ext/push_client.PushConnection). Unlike the engine,
which applies between scheduler steps, it applies on its own IO thread: the middleware
on the event loop reads ``table`` once per request and makes one lookup in it, a
snapshot swaps the whole table and an op sets or removes one item, so no lock is
needed. While the control plane is down the last keys stay in force; a revoked key
stops working when its op arrives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_ext.push_client import Prepared, PushConnection
from output_rate_core import protocol as p
from output_rate_core.key_table import KeyTable


@dataclass(frozen=True)
class _PreparedKeys(Prepared):
    table: KeyTable


class KeyClient(PushConnection):
    role: p.Role = p.API_ROLE
    kept = "API keys"
    held_without_snapshot = "no API keys (every request gets 503)"

    def __init__(self, *, key_use_interval_s: float = p.KEY_USE_INTERVAL_S, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.table = KeyTable()
        self._key_use_interval_s = key_use_interval_s
        self._next_key_use_at = time.monotonic() + key_use_interval_s
        # key id -> last use (Unix seconds), since the last report; written by the event loop
        self._used: dict[str, float] = {}
        # Called on the IO thread once keys changed (a snapshot, a key op): the middleware
        # ends the requests running with a key that is gone.
        self.on_change: Callable[[], None] = lambda: None

    def note_use(self, key_id: str) -> None:
        """Record that a request was let through with this key (event loop thread)."""
        self._used[key_id] = time.time()

    def _prepare(self, snapshot: p.Snapshot) -> _PreparedKeys:
        return _PreparedKeys(snapshot.version, snapshot, KeyTable.from_snapshot(snapshot))

    def _install_snapshot(self, prepared: Prepared) -> None:
        assert isinstance(prepared, _PreparedKeys)
        self.table = prepared.table
        self.on_change()

    def _apply_op(self, op: p.Op) -> None:
        # One dict item set or removed: atomic for the event loop's single lookup.
        if self.table.apply(op):
            self.on_change()

    def _on_io_tick(self) -> None:
        self._drain()
        now = time.monotonic()
        if now < self._next_key_use_at:
            return
        self._next_key_use_at = now + self._key_use_interval_s
        if not self._used:
            return
        # A use noted while this runs lands in the old dict or the new one; one noted
        # into the old after it was read is restated by the key's next use.
        used, self._used = self._used, {}
        items = list(used.items())
        for start in range(0, len(items), p.MAX_KEY_USES):
            part = dict(items[start : start + p.MAX_KEY_USES])
            self._send(p.KeyUse(self.engine_id, part))
