"""The limits `output-rate serve` puts on HTTP connections, beyond what uvicorn does.

Every connection is held, before any authentication, to output_rate_core/http_guard.py's
guard (docs/deploy.md, "Built-in limits"): a bounded request head, the head and idle
timeouts, and the connection bounds. This module derives those bounds from the settings
and the process's open-file limit, words the guard's own answers as every other error of
the API, and logs what it turned away.
"""

from __future__ import annotations

import json
import logging
import resource
import time
from dataclasses import dataclass

from control_plane.edge import SECURITY_HEADERS
from control_plane.errors import ConfigurationError
from control_plane.settings import Settings, variable
from output_rate_core.http_guard import (
    ErrorResponses,
    GuardedProtocol,
    GuardUnavailable,
    HttpLimits,
)
from output_rate_core.http_guard import guarded_protocol as guard

logger = logging.getLogger("control_plane")

# Open files kept for all but HTTP connections: the database pool (up to 50 connections,
# 2 files each on SQLite), engines' ZMQ connections, log files, the event loop's own. At
# most half of the limit, so a small limit still serves (fewer) connections.
RESERVED_FILES = 256
MIN_OPEN_FILES = 64
# The default bound on connections served at once: an admin API has few clients, and a
# connection beyond this many costs memory without serving anyone.
DEFAULT_MAX_CONNECTIONS = 4096
# At most one warning about shed connections per interval, with the counts since the last.
SHED_LOG_INTERVAL_S = 10.0
# The open-file limit tried when the hard limit is unlimited (macOS).
UNLIMITED_FILES_TARGET = 65536


@dataclass(frozen=True)
class OpenFileLimit:
    num_files: int  # the soft limit now
    num_files_before: int  # the soft limit the process started with


def raise_open_file_limit() -> OpenFileLimit:
    """Raise this process's open-file soft limit to its hard limit: every connection is a
    file, and a common default soft limit (1,024) is far below the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_FILES_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return OpenFileLimit(num_files=_finite(soft), num_files_before=_finite(soft))
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:
        logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
        return OpenFileLimit(num_files=soft, num_files_before=soft)
    return OpenFileLimit(num_files=target, num_files_before=soft)


def _finite(num_files: int) -> int:
    return UNLIMITED_FILES_TARGET if num_files == resource.RLIM_INFINITY else num_files


def http_limits(settings: Settings, num_files: int) -> HttpLimits:
    """The connection bounds for an open-file limit of `num_files`; ConfigurationError
    when the limit cannot serve them."""
    if num_files < MIN_OPEN_FILES:
        raise ConfigurationError(
            f"the open-file limit is {num_files}, too low to serve HTTP; raise it to at "
            f"least {RESERVED_FILES * 2} (ulimit -n, or LimitNOFILE= in a systemd unit)"
        )
    usable = num_files - min(RESERVED_FILES, num_files // 2)
    configured = settings.http_max_connections
    if configured is None:
        max_connections = min(DEFAULT_MAX_CONNECTIONS, usable * 7 // 8)
    elif configured > usable:
        raise ConfigurationError(
            f"{variable('http_max_connections')}={configured} needs more files than the "
            f"open-file limit of {num_files} leaves ({num_files - usable} are kept for the "
            f"database, ZMQ and logs): at most {usable}, or raise the limit (ulimit -n, or "
            "LimitNOFILE= in a systemd unit)"
        )
    else:
        max_connections = configured
    return HttpLimits(
        header_timeout_s=settings.http_header_timeout_s,
        idle_timeout_s=settings.http_idle_timeout_s,
        max_head_bytes=settings.http_max_header_bytes,
        max_connections=max_connections,
        max_open=min(usable, 2 * max_connections),
    )


class _ShedLog:
    """Counts connections turned away at the bounds; warns at most once per
    SHED_LOG_INTERVAL_S, with the counts since the last warning."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        # how a connection was turned away -> how many since the last warning
        self.counts = {"dropped": 0, "shed": 0, "closed": 0}
        self._last_warning = -SHED_LOG_INTERVAL_S

    def note(self, how: str) -> None:
        self.counts[how] += 1
        now = time.monotonic()
        if now - self._last_warning < SHED_LOG_INTERVAL_S:
            return
        self._last_warning = now
        logger.warning(
            "%d HTTP connections open (%s): %d yet to send a request dropped for new ones, "
            "%d answered 503, %d over %d closed unread",
            self.limits.max_connections,
            variable("http_max_connections"),
            self.counts["dropped"],
            self.counts["shed"],
            self.counts["closed"],
            self.limits.max_open,
        )
        self.counts = dict.fromkeys(self.counts, 0)


def _error_body(status: int, detail: str) -> bytes:
    return json.dumps({"detail": detail, "field": None}).encode()


def guarded_protocol(limits: HttpLimits) -> type[GuardedProtocol]:
    """The protocol class for uvicorn's `http=`; ConfigurationError when the installed
    uvicorn lacks what the guard relies on."""
    shed_log = _ShedLog(limits)
    errors = ErrorResponses(
        body=_error_body, headers=tuple(SECURITY_HEADERS), on_turned_away=shed_log.note
    )
    try:
        return guard(limits, errors)
    except GuardUnavailable as e:
        raise ConfigurationError(str(e)) from None
