"""What one engine connection's Demand frames may claim (docs/fleet.md, "Trust").

Demand splits a fleet user's limit between its engines, so an authenticated engine that
claims more streams than it holds would draw the user's shares away from the honest ones
(before: `Demand(streams={"tenant": 2**53})` left every honest engine at 0.001 tok/s).
The replica an engine talks to bounds what it passes on, before the allocator (or the
leader, through the relay) sees it:

- a user's count is cut to the engine's capacity (its max_num_seqs, said at HELLO; at
  most MAX_ENGINE_CAPACITY), and such users are named in the Demand passed on
  (``over_capacity``): the allocator counts them no busier than the busiest engine that
  claims within its capacity (control_plane/fleet/allocator.py);
- at most MAX_DEMAND_FRAMES_PER_S frames and MAX_DEMAND_BYTES_PER_S bytes a second per
  connection (a burst of MAX_DEMAND_FRAME_BURST frames, one largest frame); beyond, a
  frame is refused and counted before it is decoded (decoding is what a flood costs);
- at most MAX_DEMAND_USERS users with demand per connection: the allocator's memory for
  one engine is bounded whatever it sends; further users are dropped;
- a count over IMPLAUSIBLE_FACTOR x the capacity (no queue is that long), users beyond
  the bound, or a total over IMPLAUSIBLE_FACTOR x the capacity flag the engine: counted,
  logged once per reason, in the push metrics and on its row of GET /engines;
- the users with demand whose last usage report from the engine bears out the streams
  it claims (``MIN_TOKENS_PER_STREAM_S`` granted per stream, or throttled or
  would-throttle steps: its share holds them back) are named in every Demand passed on
  (``evidenced``), and a usage report that changes that set passes on a Demand of no
  streams naming it: the allocator counts an engine that shows no such evidence no
  busier than the busiest engine of the user that does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from control_plane.usage.book import Pace
from output_rate_core import protocol as p

# More streams than the engine runs at once, with a waiting queue 15 times as long: no
# honest engine claims that.
IMPLAUSIBLE_FACTOR = 16
# Tokens a second granted per claimed stream that bear the claim out: an engine running a
# user's streams unthrottled decodes far more; one held back by its share is throttled.
MIN_TOKENS_PER_STREAM_S = 1.0


def engine_capacity(said: int) -> int:
    """The capacity a connection's demand counts up to (``said`` at HELLO; 0: not said)."""
    if said <= 0:
        return p.DEFAULT_ENGINE_CAPACITY
    return min(said, p.MAX_ENGINE_CAPACITY)


def _frames_pace() -> Pace:
    return Pace(p.MAX_DEMAND_FRAMES_PER_S, p.MAX_DEMAND_FRAME_BURST / p.MAX_DEMAND_FRAMES_PER_S)


def _bytes_pace() -> Pace:
    return Pace(p.MAX_DEMAND_BYTES_PER_S, p.MAX_DEMAND_BYTES_BURST / p.MAX_DEMAND_BYTES_PER_S)


@dataclass
class DemandBounds:
    """One engine connection's demand as passed on, and its bounds."""

    capacity: int
    # user -> streams, as passed on (each at most the capacity)
    streams: dict[str, int] = field(default_factory=dict)
    total: int = 0
    frames: Pace = field(default_factory=_frames_pace)
    bytes: Pace = field(default_factory=_bytes_pace)
    num_refused: int = 0
    num_implausible: int = 0
    # Users with demand whose last usage report naming them bore out the streams claimed.
    evidenced: set[str] = field(default_factory=set)
    # The stalled users of the last frame passed on (restated by a usage-made frame).
    stalled: list[str] = field(default_factory=list)

    def admit(self, now: float, size: int) -> bool:
        """Whether a frame of ``size`` bytes is within the rates (taken if so; counted if
        not)."""
        if not (self.frames.fits(now, 1) and self.bytes.fits(now, size)):
            self.num_refused += 1
            return False
        self.frames.take(now, 1)
        self.bytes.take(now, size)
        return True

    def bound(self, demand: p.Demand) -> tuple[p.Demand, str]:
        """The frame to pass on (an admitted one), and why the engine is flagged (""
        when it is not)."""
        cap = self.capacity
        implausible = ""
        if demand.full:
            self.streams, self.total = {}, 0
        passed: dict[str, int] = {}
        over: list[str] = []
        for user, claimed in demand.streams.items():
            num = claimed
            if num > cap:
                over.append(user)
                num = cap
                if claimed > IMPLAUSIBLE_FACTOR * cap:
                    implausible = f"{claimed} streams of one user (capacity {cap})"
            old = self.streams.get(user, 0)
            if num and not old and len(self.streams) >= p.MAX_DEMAND_USERS:
                implausible = f"demand for over {p.MAX_DEMAND_USERS} users"
                continue
            if num:
                self.streams[user] = num
            elif old:
                del self.streams[user]
            self.total += num - old
            passed[user] = num
        if self.total > IMPLAUSIBLE_FACTOR * cap:
            implausible = implausible or f"{self.total} streams in all (capacity {cap})"
        if implausible:
            self.num_implausible += 1
        # Stalled users count only among those it has demand for.
        self.stalled = [user for user in demand.stalled if user in self.streams]
        # A user whose demand ended starts again with no evidence.
        self.evidenced.intersection_update(self.streams)
        bounded = p.Demand(
            demand.engine_id,
            demand.full,
            passed,
            over_capacity=over,
            stalled=self.stalled,
            evidenced=sorted(self.evidenced),
        )
        return bounded, implausible

    def usage(self, engine_id: str, report: p.Usage, now: float) -> p.Demand | None:
        """Take what a usage report (or one part of it) shows of the users with demand
        here: evidenced when it granted them MIN_TOKENS_PER_STREAM_S per stream claimed or
        counted throttled or would-throttle steps (their share holds them back), not
        otherwise; users it does not name keep what they showed. A frame to pass on when
        the set changed (no streams, the stalled set as last passed), else None; within
        the connection's frame rate (one over it is not sent: every frame passed on names
        the whole set, the next restates it)."""
        changed = False
        for user in itertools.chain(report.granted, report.throttled, report.would_throttle):
            if user not in self.streams:
                continue
            shown = (
                report.granted.get(user, 0)
                >= MIN_TOKENS_PER_STREAM_S * self.streams[user] * report.interval_s
                or report.throttled.get(user, 0) > 0
                or report.would_throttle.get(user, 0) > 0
            )
            if shown != (user in self.evidenced):
                changed = True
                if shown:
                    self.evidenced.add(user)
                else:
                    self.evidenced.discard(user)
        if not changed or not self.frames.fits(now, 1):
            return None
        self.frames.take(now, 1)
        return p.Demand(
            engine_id, False, {}, stalled=self.stalled, evidenced=sorted(self.evidenced)
        )
