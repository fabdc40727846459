"""Versioned writes (RFC 9110 conditional requests): the ETag of a user's record, a tier
and the default limit, and the If-Match a write of one of them may carry.

An entity tag is the record's version, quoted: `"57"` (a strong validator). What each
record's version is, and what a write checks against it, is decided by the limit writes
(control_plane/limits/service.py, `LimitWrite`) inside their transaction; this module only
reads and writes the header syntax.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from control_plane.errors import DomainError, InvalidInput

IF_MATCH = "If-Match"
ETAG = "ETag"

# One entity tag of a list (RFC 9110 section 8.8.3): an optional weakness prefix, the
# quoted opaque characters (no quotes, controls or spaces inside; a comma may be one),
# then a comma or the end.
_LIST_ITEM = re.compile(r'[ \t]*(W/)?"([\x21\x23-\x7e\x80-\xff]*)"[ \t]*(,|$)')


def etag(version: int) -> str:
    """The ETag header value of a record at `version`."""
    return f'"{version}"'


@dataclass(frozen=True)
class IfMatch:
    """An If-Match header: `*` (any current representation), or the strong entity tags
    it lists. Weak tags never match (If-Match compares strongly, RFC 9110 section 13.1.1);
    a tag that is no version simply matches nothing."""

    any: bool
    versions: frozenset[int]

    def matches(self, version: int | None) -> bool:
        """Whether the condition holds for a record now at `version` (None: there is no
        representation at all, like a tier that does not exist)."""
        if version is None:
            return False
        return self.any or version in self.versions

    def __str__(self) -> str:
        return "*" if self.any else ", ".join(etag(v) for v in sorted(self.versions))


def parse_if_match(value: str | None) -> IfMatch | None:
    """The condition an If-Match header states (None: no header, an unconditional write);
    malformed: 422 naming the header."""
    if value is None:
        return None
    if value.strip() == "*":
        return IfMatch(any=True, versions=frozenset())
    versions: set[int] = set()
    position = 0
    while True:
        item = _LIST_ITEM.match(value, position)
        if item is None:
            raise InvalidInput(
                f'{IF_MATCH}: expected "*" or quoted entity tags such as "57", got {value[:60]!r}',
                field=IF_MATCH,
            )
        weak, opaque, separator = item.groups()
        if not weak and opaque.isascii() and opaque.isdigit() and len(opaque) <= 18:
            versions.add(int(opaque))
        position = item.end()
        if not separator:
            return IfMatch(any=False, versions=frozenset(versions))


class PreconditionFailed(DomainError):
    """A versioned write whose If-Match no longer holds: nothing was written (412). Names
    the record's current version (None: there is no such record) in the body and, as its
    ETag, in the headers, so that a client can read it again and decide."""

    status_code = 412

    def __init__(self, message: str, *, current_version: int | None) -> None:
        super().__init__(message, field=IF_MATCH)
        self.current_version = current_version

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.current_version is None else {ETAG: etag(self.current_version)}

    @property
    def extra(self) -> dict[str, Any]:
        return {"current_version": self.current_version}
