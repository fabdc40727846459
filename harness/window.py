"""The window bound every limit keeps, checked on measured token times.

In any window of W seconds a user gets at most ``(W + burst) x N + 1`` tokens
(docs/scheduler.md). Times are integer ns so the check is exact: a window that
holds exactly the bound is within it, whatever the rate.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine_ext.limiter import DEFAULT_BURST_NS, NS_PER_S


def worst_window_excess(
    events: Iterable[tuple[int, int]],
    rate: int,
    *,
    burst_ns: int = DEFAULT_BURST_NS,
    slack_ns: int = 0,
    longest_ns: int | None = None,
) -> float:
    """The most tokens any window [t_i, t_j] holds beyond ``(W + burst + slack) x rate + 1``
    (<= 0: the bound holds). ``events``: (time ns, tokens received then); ``longest_ns``:
    only windows up to that long (a long run's every window is quadratic in its tokens)."""
    ordered = sorted(events)
    worst = None
    for i, (start, _) in enumerate(ordered):
        total = 0
        for j in range(i, len(ordered)):
            end, num = ordered[j]
            if longest_ns is not None and end - start > longest_ns:
                break
            total += num
            excess = total * NS_PER_S - ((end - start + burst_ns + slack_ns) * rate + NS_PER_S)
            worst = excess if worst is None or excess > worst else worst
    return 0.0 if worst is None else worst / NS_PER_S


def to_ns(seconds: float) -> int:
    return round(seconds * NS_PER_S)
