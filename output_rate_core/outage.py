"""What engines do when their lease of fleet shares ends: the control plane's setting
(OUTPUT_RATE_OUTAGE_POLICY, control_plane/settings.py), sent to engines with their shares
(protocol.Shares). The share each mode gives is output_rate_core.limits.outage_share;
docs/fleet.md ("Outage, engine death, partition") states the bound of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# What engines do when their lease of fleet shares ends (the control plane's setting, sent
# with the shares; docs/fleet.md, "Outage, engine death, partition"):
# "serving": a user the engine held a share of falls to L / (the engines serving that
# user, as the control plane last said with the share); "keep": the engine keeps its last
# shares for ``keep_s`` more, then as "serving"; "fraction": every fleet user gets
# ``fraction`` x L on each engine.
OutageMode = Literal["serving", "keep", "fraction"]
SERVING: OutageMode = "serving"
KEEP: OutageMode = "keep"
FRACTION: OutageMode = "fraction"
OUTAGE_MODES: tuple[OutageMode, ...] = (SERVING, KEEP, FRACTION)
MAX_OUTAGE_KEEP_S = 3600.0


@dataclass(frozen=True, slots=True)
class OutagePolicy:
    """What an engine enforces of fleet limits once its lease of shares ended."""

    mode: OutageMode = SERVING
    # "keep": seconds past the lease the engine keeps its last shares (0 otherwise).
    keep_s: float = 0.0
    # "fraction": the part of L each engine enforces, in (0, 1] (0 otherwise).
    fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in OUTAGE_MODES:
            raise ValueError(f"outage mode must be one of {OUTAGE_MODES}, got {self.mode!r}")
        if self.mode == KEEP:
            if not 0 < self.keep_s <= MAX_OUTAGE_KEEP_S:
                raise ValueError(f"keep_s must be in (0, {MAX_OUTAGE_KEEP_S}], got {self.keep_s}")
        elif self.keep_s:
            raise ValueError(f"keep_s is for the {KEEP!r} mode only, got {self.keep_s}")
        if self.mode == FRACTION:
            if not 0 < self.fraction <= 1:
                raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        elif self.fraction:
            raise ValueError(f"fraction is for the {FRACTION!r} mode only, got {self.fraction}")

    @property
    def kept_s(self) -> float:
        """How long past its lease an engine may still enforce its last shares."""
        return self.keep_s if self.mode == KEEP else 0.0


DEFAULT_OUTAGE = OutagePolicy()
