"""One limit model kept at the config log's newest version, for the readers that hold
one: the fleet coordinator (control_plane/fleet/coordinator.py) and the usage history
(control_plane/usage/history.py).

The rule, written once: a follower that has a version reads the log after it and applies
each op in version order; the first time, or when the log no longer holds the next
version (pruned), it starts over from a snapshot. Reading (the database) and applying
(memory) are two calls, so that a reader whose model other threads see applies under its
own lock without holding it across a database read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from control_plane.config import service as config
from control_plane.config.repository import Change
from control_plane.db import Database
from output_rate_core import protocol as p
from output_rate_core.limits import EVERYONE, LimitModel


class ConfigLog(Protocol):
    """Where a follower reads the log."""

    def snapshot(self) -> p.Snapshot: ...

    def changes_since(self, version: int) -> list[Change]: ...


class StoredLog:
    """The log in the database, read in a transaction of its own on the calling thread
    (a thread of its own, never the event loop)."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def snapshot(self) -> p.Snapshot:
        return self._db.run_now(config.load_snapshot)

    def changes_since(self, version: int) -> list[Change]:
        return self._db.run_now(config.changes_since, version)


@dataclass(frozen=True)
class Catchup:
    """What brings a follower to the log's newest version: the changes after its version,
    or, when the log cannot (first time, or pruned past it), a snapshot."""

    changes: list[Change] = field(default_factory=list)
    snapshot: p.Snapshot | None = None


# Told the users an op may have changed the limit of (EVERYONE: any user, as after the
# default changed or a snapshot replaced the model).
OnChange = Callable[[set[str] | None], None]


def _ignore(users: set[str] | None) -> None:
    pass


class LogFollower:
    def __init__(self) -> None:
        self.model = LimitModel()
        # The log's version the model is at (None: nothing read yet; the model is empty).
        self.version: int | None = None

    def read(self, log: ConfigLog) -> Catchup | None:
        """What the log holds past the model (None: the model is at its newest version)."""
        if self.version is not None:
            changes = log.changes_since(self.version)
            if not changes:
                return None
            if changes[0][0] == self.version + 1:
                return Catchup(changes)
        return Catchup(snapshot=log.snapshot())

    def apply(self, catchup: Catchup, on_change: OnChange = _ignore) -> None:
        """Bring the model to `catchup`'s version; `on_change` after each op (once, with
        EVERYONE, for a snapshot). An op that cannot be decoded raises
        (output_rate_core.protocol.ProtocolError) with the model at the version before."""
        if catchup.snapshot is not None:
            self.model = LimitModel.from_snapshot(catchup.snapshot)
            self.version = catchup.snapshot.version
            on_change(EVERYONE)
            return
        for version, rows in catchup.changes:
            for op in p.ops_from_rows(rows):
                on_change(self.model.apply(op))
            self.version = version
