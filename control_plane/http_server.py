"""The limits `output-rate serve` puts on HTTP connections, beyond what uvicorn does.

uvicorn times out only an idle kept-alive connection, and only after a response: a client
that connects and sends nothing, half a request head or part of a body would hold its
connection, one open file, for good, and enough of them exhaust the process's files. So
every connection is guarded, before any authentication (docs/deploy.md, "Built-in
limits"):

- its request head must be complete `header_timeout_s` after the connection opened, or
  after the head's first byte on a kept-alive connection;
- a request body may pause at most `idle_timeout_s`, and so may a client that stops
  reading its response;
- at `max_connections` open, a new connection takes the place of the oldest one yet to
  send its first whole request head (so a flood of silent connections cannot lock out a
  client that talks); when every open connection has sent a request, the new one gets a
  503 with Retry-After as soon as its head arrives (within SHED_HEADER_TIMEOUT_S), and
  beyond `max_open` it is closed at once, unread. A connection that has sent a request is
  never turned away for a new one.

Time the server itself does not read (a pipelined request waiting for the one before it, a
body the application has not asked for yet) and a client waiting for its 100 Continue are
not held against the client. A request head that times out gets a 408 (a connection that
sent nothing is just closed, as after the keep-alive timeout).

The guard is a subclass of the HTTP/1.1 protocol uvicorn itself picks (httptools when
installed, else h11); what it uses of uvicorn's internals is listed in UVICORN_MEMBERS
and checked by `guarded_protocol` before the server starts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from control_plane.edge import SECURITY_HEADERS
from control_plane.errors import ConfigurationError
from control_plane.settings import Settings, variable

logger = logging.getLogger("control_plane")

# Open files kept for all but HTTP connections: the database pool (up to 50 connections,
# 2 files each on SQLite), engines' ZMQ connections, log files, the event loop's own. At
# most half of the limit, so a small limit still serves (fewer) connections.
RESERVED_FILES = 256
MIN_OPEN_FILES = 64
# The default bound on connections served at once: an admin API has few clients, and a
# connection beyond this many costs memory without serving anyone.
DEFAULT_MAX_CONNECTIONS = 4096
# A connection over max_connections gets this long to send its head and hear the 503.
SHED_HEADER_TIMEOUT_S = 1.0
SHED_RETRY_AFTER_S = 1
# At most one warning about shed connections per interval, with the counts since the last.
SHED_LOG_INTERVAL_S = 10.0
# The open-file limit tried when the hard limit is unlimited (macOS).
UNLIMITED_FILES_TARGET = 65536

# What the guard uses of uvicorn's HTTP/1.1 protocols (HttpToolsProtocol, H11Protocol),
# their RequestResponseCycle and FlowControl, written against uvicorn 0.54.0: class -> the
# methods it overrides or the attributes it reads, set by the constructor or, for a
# protocol, by connection_made.
UVICORN_MEMBERS: dict[str, tuple[str, ...]] = {
    "protocol methods": (
        "connection_made",
        "connection_lost",
        "data_received",
        "on_response_complete",
        "pause_writing",
        "resume_writing",
    ),
    "protocol attributes": ("app", "connections", "cycle", "flow", "loop", "transport"),
    "RequestResponseCycle": (
        "more_body",
        "response_complete",
        "response_started",
        "waiting_for_100_continue",
    ),
    "FlowControl": ("read_paused",),
}


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float
    idle_timeout_s: float
    max_connections: int
    # Connections open at all (served, or being answered 503); beyond: closed unread.
    max_open: int


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


def _error_body(detail: str) -> bytes:
    return json.dumps({"detail": detail, "field": None}).encode()


def _timeout_response(detail: str) -> bytes:
    """A whole 408 response, written straight to the connection before it closes."""
    body = _error_body(detail)
    head = [
        b"HTTP/1.1 408 Request Timeout",
        b"content-type: application/json",
        b"content-length: " + str(len(body)).encode(),
        b"connection: close",
        *(name + b": " + value for name, value in SECURITY_HEADERS),
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class GuardedProtocol(asyncio.Protocol):
    """The guard (module doc) over uvicorn's protocol; `guarded_protocol` makes the
    subclass that uvicorn runs."""

    limits: ClassVar[HttpLimits]
    parser: ClassVar[str]
    shed_log: ClassVar[_ShedLog]
    # The connections yet to send their first whole request head, oldest first.
    first_heads: ClassVar[dict[GuardedProtocol, None]]
    shed_body: ClassVar[bytes]
    # uvicorn's (UVICORN_MEMBERS)
    app: Any
    connections: set[Any]
    cycle: Any
    flow: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        num_open = len(self.connections)
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._write_timer: asyncio.TimerHandle | None = None
        # The request whose head was parsed last; the next head is timed from its first
        # byte (from now for the first one).
        self._cycle_seen: Any = None
        self._head_since: float | None = self.loop.time()
        self._head_bytes = False
        self._header_timeout_s = self.limits.header_timeout_s
        if num_open >= self.limits.max_open:
            self.shed_log.note("closed")
            self.transport.close()
            return
        if num_open >= self.limits.max_connections and not self._make_room():
            self.shed_log.note("shed")
            self.app = self._shed
            self._header_timeout_s = min(SHED_HEADER_TIMEOUT_S, self._header_timeout_s)
        else:
            self.first_heads[self] = None
        self._rearm()

    def _make_room(self) -> bool:
        """Drop the oldest connection yet to send a whole request head, so that silent
        connections cannot lock out a client that talks; False if there is none."""
        while self.first_heads:
            oldest = next(iter(self.first_heads))
            del self.first_heads[oldest]
            if not oldest.transport.is_closing():
                self.shed_log.note("dropped")
                oldest._drop("request head: not complete when its connection was needed")
                return True
        return False

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.more_body:
            # These bytes begin (or go on with) the head of the next request.
            self._head_bytes = True
            if self._head_since is None:
                self._head_since = self.loop.time()
        super().data_received(data)
        self._rearm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._rearm()

    def pause_writing(self) -> None:
        super().pause_writing()
        # The client stopped reading the response; abort, as close() would wait to flush.
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(
                self.limits.idle_timeout_s, self.transport.abort
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.first_heads.pop(self, None)
        for timer in (self._timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._write_timer = None
        super().connection_lost(exc)

    def _receiving_body(self) -> bool:
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete and bool(cycle.more_body)

    def _rearm(self) -> None:
        cycle = self.cycle
        if cycle is not self._cycle_seen:
            self._cycle_seen = cycle
            self.first_heads.pop(self, None)
            self._head_since = None
            self._head_bytes = False
        if self._receiving_body():
            self._arm(self.loop.time() + self.limits.idle_timeout_s)
        elif self._head_since is not None and (cycle is None or cycle.response_complete):
            self._arm(self._head_since + self._header_timeout_s)
        elif self._timer is not None:
            # The application has the whole request: the client owes nothing.
            self._timer.cancel()
            self._timer = None

    def _arm(self, deadline: float) -> None:
        if self._timer is not None:
            if deadline == self._deadline:
                return
            self._timer.cancel()
        self._deadline = deadline
        self._timer = self.loop.call_at(deadline, self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        cycle = self.cycle
        if self.transport.is_closing():
            return
        if self.flow.read_paused or (
            cycle is not None and not cycle.response_complete and cycle.waiting_for_100_continue
        ):
            # The server is not reading, or the client waits for its 100 Continue.
            self._arm(self.loop.time() + self.limits.idle_timeout_s)
            return
        if self._receiving_body():
            if not cycle.response_started:
                detail = f"request body: nothing received for {self.limits.idle_timeout_s:g} s"
                self.transport.write(_timeout_response(detail))
            self.transport.close()
        else:
            self._drop(f"request head: not complete within {self._header_timeout_s:g} s")

    def _drop(self, detail: str) -> None:
        """Close a connection owing a request head: with a 408 if part of it came."""
        self.first_heads.pop(self, None)
        if self._head_bytes:
            self.transport.write(_timeout_response(detail))
        self.transport.close()

    async def _shed(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI app of a connection over max_connections: 503, then close."""
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(self.shed_body)).encode()),
            (b"retry-after", str(SHED_RETRY_AFTER_S).encode()),
            (b"connection", b"close"),
            *SECURITY_HEADERS,
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": self.shed_body})


def _uvicorn_protocol() -> type[asyncio.Protocol]:
    """The HTTP/1.1 protocol uvicorn's "auto" picks: httptools when installed, else h11."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    return HttpToolsProtocol


def _missing_members(base: type[asyncio.Protocol]) -> list[str]:
    from uvicorn.protocols.http.flow_control import FlowControl

    cycle = getattr(sys.modules[base.__module__], "RequestResponseCycle", None)

    # Attributes are checked by the names their constructor (and, for the protocol,
    # connection_made) assigns or reads: no instance is needed.
    def names(cls: Any, *methods: str) -> set[str]:
        code = [getattr(getattr(cls, m, None), "__code__", None) for m in methods]
        return {name for c in code if c is not None for name in c.co_names}

    have = {
        "protocol methods": {m for m in UVICORN_MEMBERS["protocol methods"] if hasattr(base, m)},
        "protocol attributes": names(base, "__init__", "connection_made"),
        "RequestResponseCycle": names(cycle, "__init__"),
        "FlowControl": names(FlowControl, "__init__"),
    }
    return [
        f"{owner}.{member}"
        for owner, members in UVICORN_MEMBERS.items()
        for member in members
        if member not in have[owner]
    ]


def guarded_protocol(limits: HttpLimits) -> type[GuardedProtocol]:
    """The protocol class for uvicorn's `http=`; ConfigurationError when the installed
    uvicorn lacks what the guard relies on."""
    import uvicorn

    base = _uvicorn_protocol()
    missing = _missing_members(base)
    if missing:
        raise ConfigurationError(
            f"uvicorn {uvicorn.__version__}'s {base.__name__} lacks {', '.join(missing)}, "
            "which control_plane/http_server.py relies on (written against uvicorn 0.54.0)"
        )
    shed_body = _error_body(
        f"too many connections: this server serves {limits.max_connections} at once; retry"
    )
    parser = "httptools" if "httptools" in base.__module__ else "h11"
    attributes = {
        "limits": limits,
        "parser": parser,
        "shed_log": _ShedLog(limits),
        "first_heads": {},
        "shed_body": shed_body,
    }
    return type(f"Guarded{base.__name__}", (GuardedProtocol, base), attributes)
