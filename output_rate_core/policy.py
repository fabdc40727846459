"""A limit's policy: one value for what a user, a tier or the default says.

``rate``: output tokens/s (None: unlimited, or, on a user, no override). ``scope``:
``"fleet"``, the rate is what the user gets summed over every engine of one control
plane (engines enforce shares of it, docs/fleet.md), or ``"engine"``, each engine
enforces it in full. ``enforcement``: ``"enforce"``, the limit holds the user back, or
``"shadow"``, what it would refuse is counted and nothing is refused. ``ceiling``: output
tokens/s the user may reach above its rate by borrowing capacity no other user needs
(None: not set; the default's None means no borrowing). A field of None is not set there:
it inherits (output_rate_core.limits.LimitModel.resolve says from whom).

A new field is added here with a default of None, then to the ops and the snapshot
(output_rate_core/protocol.py: their accessors and wire fields), to the resolver, and to
the rows and bodies of the control plane.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Scope = Literal["fleet", "engine"]
# "shadow": the limit is computed and would-throttles counted, nothing is refused.
Enforcement = Literal["enforce", "shadow"]


# A frozen msgspec Struct rather than a dataclass: built about as fast as a tuple (an
# engine builds one per user of a snapshot), immutable, compared and hashed by value; not
# tracked by the garbage collector (gc=False: it holds only numbers and strings, so it can
# be in no cycle). It is no message: the wire carries its fields flat
# (output_rate_core/protocol.py).
class Policy(msgspec.Struct, frozen=True, gc=False):
    rate: int | None = None
    scope: Scope | None = None
    enforcement: Enforcement | None = None
    ceiling: int | None = None


# Nothing set: a user with no own value, a tier or a default that sets nothing.
NO_POLICY = Policy()
