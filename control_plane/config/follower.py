"""One limit model kept at the config log's newest version, for the readers that hold
one: the fleet coordinator (control_plane/fleet/coordinator.py, its reads made by the
push server's log reader) and the usage history (control_plane/usage/history.py).

The rule, written once (`read_catchup`): a model at a version reads the log after it and
applies each op in version order; the first time, or when the log no longer holds the
next version (pruned), it starts over from a snapshot. Reading (the database) and
applying (memory) are two steps, so that the read can run on a thread of its own and a
model that other threads see is changed under its owner's lock without holding it across
a database read."""

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
    """What brings a limit model at version `at` (None: empty, nothing read yet) to the
    log's newest version: the changes after `at`, or, when they cannot (the model is
    empty, or the log was pruned past `at`), a snapshot."""

    at: int | None
    changes: list[Change] = field(default_factory=list)
    snapshot: p.Snapshot | None = None

    @property
    def version(self) -> int | None:
        """The version the model is at once brought up with it."""
        if self.snapshot is not None:
            return self.snapshot.version
        return self.changes[-1][0] if self.changes else self.at

    @property
    def up_to_date(self) -> bool:
        """The model was at the newest version already: nothing to apply."""
        return self.snapshot is None and not self.changes


def read_catchup(log: ConfigLog, at: int | None) -> Catchup:
    """The follow rule, the only place it is written: the changes after `at` when they
    start right after it, else a snapshot. Reads only (a thread of its own may read it
    for a model another thread applies it to)."""
    if at is not None:
        changes = log.changes_since(at)
        if not changes or changes[0][0] == at + 1:
            return Catchup(at, changes)
    return Catchup(at, snapshot=log.snapshot())


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

    def read(self, log: ConfigLog) -> Catchup:
        return read_catchup(log, self.version)

    def apply(self, catchup: Catchup, on_change: OnChange = _ignore) -> None:
        """Bring the model to `catchup`'s version; `on_change` after each op (once, with
        EVERYONE, for a snapshot). An op that cannot be decoded raises
        (output_rate_core.protocol.ProtocolError) with the model at the version before."""
        assert catchup.at == self.version, "a catch-up read at another version"
        if catchup.snapshot is not None:
            self.model = LimitModel.from_snapshot(catchup.snapshot)
            self.version = catchup.snapshot.version
            on_change(EVERYONE)
            return
        for version, rows in catchup.changes:
            for op in p.ops_from_rows(rows):
                on_change(self.model.apply(op))
            self.version = version
