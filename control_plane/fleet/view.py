"""The fleet views (control_plane/deps.py, FleetView) the app is given: none, or the
allocator this replica runs now."""

from __future__ import annotations

from collections.abc import Callable

from control_plane.deps import FleetView


class NoFleet:
    """Without a push server: no engine holds a share."""

    def shares_of(self, user: str) -> dict[str, int]:
        return {}

    def num_shared_users(self, engine_id: str) -> int:
        return 0


class CurrentFleet:
    """The coordinator this replica runs now, if any (with replicas only the leader runs
    one; a follower shows the shares the leader last wrote: replicas/live_usage.py)."""

    def __init__(self, current: Callable[[], FleetView | None]) -> None:
        self._current = current

    def shares_of(self, user: str) -> dict[str, int]:
        fleet = self._current()
        return {} if fleet is None else fleet.shares_of(user)

    def num_shared_users(self, engine_id: str) -> int:
        fleet = self._current()
        return 0 if fleet is None else fleet.num_shared_users(engine_id)
