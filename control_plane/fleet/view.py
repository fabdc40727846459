"""What the REST API shows of fleet shares (GET /limits/{user}, GET /engines): read from
the allocator the push server runs, through this narrow interface."""

from __future__ import annotations

from typing import Protocol


class FleetView(Protocol):
    def shares_of(self, user: str) -> dict[str, int]:
        """engine id -> the share (milli-tokens/s) it may be enforcing for the user."""
        ...

    def num_shared_users(self, engine_id: str) -> int:
        """Users the engine holds a share for."""
        ...


class NoFleet:
    """Without a push server: no engine holds a share."""

    def shares_of(self, user: str) -> dict[str, int]:
        return {}

    def num_shared_users(self, engine_id: str) -> int:
        return 0
