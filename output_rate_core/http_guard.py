"""The guard both HTTP servers put on every connection, before any authentication: the
control plane's `output-rate serve` (control_plane/http_server.py) and, in its identity
modes, the engine's vLLM API server (engine_ext/http_server.py).

uvicorn bounds neither the size of a request head (with httptools, the parser it picks
when installed, not at all) nor the time a client takes to send it: it times out only an
idle kept-alive connection, and only after a response. A client that sends a huge head
makes the server hold all of it; one that connects and sends nothing, half a request head
or part of a body holds its connection, one open file, for good. So:

- a request head over `max_head_bytes` is answered 431 and its connection closed, the
  rest unread;
- the head must be complete `header_timeout_s` after the connection opened, or after the
  head's first byte on a kept-alive connection;
- a request body may pause at most `idle_timeout_s`, and so may a client that stops
  reading its response;
- with `max_connections` set: at that many open, a new connection takes the place of the
  oldest one yet to send its first whole request head (so a flood of silent connections
  cannot lock out a client that talks); when every open connection has sent a request,
  the new one gets a 503 with Retry-After as soon as its head arrives (within
  SHED_HEADER_TIMEOUT_S), and beyond `max_open` it is closed at once, unread. A
  connection that has sent a request is never turned away for a new one.

Time the server itself does not read (a pipelined request waiting for the one before it, a
body the application has not asked for yet) and a client waiting for its 100 Continue are
not held against the client. A request head that times out gets a 408 (a connection that
sent nothing is just closed, as after the keep-alive timeout).

The guard is a subclass of the HTTP/1.1 protocol uvicorn itself picks (httptools when
installed, else h11); what it uses of uvicorn's internals is listed in UVICORN_MEMBERS
and checked by `guarded_protocol` before the server starts. uvicorn is imported only
there: this module stays importable without it.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_IDLE_TIMEOUT_S = 10.0
# Longer would hold a silent connection for good in all but name.
MAX_TIMEOUT_S = 300.0
# A head is a request line and a few headers (a bearer token, a content type): far below
# this. uvicorn's own bound for its h11 parser is 16 KiB.
DEFAULT_MAX_HEAD_BYTES = 64 * 1024
# A connection over max_connections gets this long to send its head and hear the 503.
SHED_HEADER_TIMEOUT_S = 1.0
SHED_RETRY_AFTER_S = 1
# The end of a request head: an empty line (parsers also take a bare LF).
_HEAD_END = re.compile(rb"\n\r?\n")

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


class GuardUnavailable(RuntimeError):
    """The installed uvicorn lacks what the guard relies on."""


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    # Connections served at once (None: no bound), and open at all (served, or being
    # answered 503); beyond: closed unread.
    max_connections: int | None = None
    max_open: int | None = None


@dataclass(frozen=True)
class ErrorResponses:
    """How a server words the answers the guard writes itself: `body(status, detail)`,
    and headers every response of that server carries."""

    body: Callable[[int, str], bytes]
    headers: tuple[tuple[bytes, bytes], ...] = ()
    # how a connection was turned away ("dropped", "shed", "closed") -> e.g. a log line
    on_turned_away: Callable[[str], None] = lambda how: None


_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class GuardedProtocol(asyncio.Protocol):
    """The guard (module doc) over uvicorn's protocol; `guarded_protocol` makes the
    subclass that uvicorn runs."""

    limits: ClassVar[HttpLimits]
    parser: ClassVar[str]
    errors: ClassVar[ErrorResponses]
    # The connections yet to send their first whole request head, oldest first.
    first_heads: ClassVar[dict[GuardedProtocol, None]]
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
        self._reset_head_size()
        self._header_timeout_s = self.limits.header_timeout_s
        limits = self.limits
        if limits.max_open is not None and num_open >= limits.max_open:
            self.errors.on_turned_away("closed")
            self.transport.close()
            return
        if (
            limits.max_connections is not None
            and num_open >= limits.max_connections
            and not self._make_room()
        ):
            self.errors.on_turned_away("shed")
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
                self.errors.on_turned_away("dropped")
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
            if not self._head_within_bound(data):
                self._refuse(431, f"request head: over {self.limits.max_head_bytes} bytes")
                return
        super().data_received(data)
        self._rearm()

    def _reset_head_size(self) -> None:
        # The bytes of the head being received (None once its end has come), whether its
        # request line has begun (empty lines before it end nothing), and its last bytes
        # (its end may straddle two reads).
        self._head_size: int | None = 0
        self._head_begun = False
        self._head_tail = b""

    def _head_within_bound(self, data: bytes) -> bool:
        """Count `data` into the head being received, up to its end."""
        if self._head_size is None:
            return True  # its end came; the rest is its body or the next request
        seen = self._head_tail + data
        start = 0
        if not self._head_begun:
            start = len(seen) - len(seen.lstrip(b"\r\n"))
            self._head_begun = start < len(seen)
        end = _HEAD_END.search(seen, start) if self._head_begun else None
        if end is not None:
            size = self._head_size + end.end() - len(self._head_tail)
            self._head_size = None
        else:
            size = self._head_size = self._head_size + len(data)
            self._head_tail = seen[-2:]
        return size <= self.limits.max_head_bytes

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
            self._reset_head_size()
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
            if cycle.response_started:
                self.transport.close()
            else:
                self._refuse(
                    408, f"request body: nothing received for {self.limits.idle_timeout_s:g} s"
                )
        else:
            self._drop(f"request head: not complete within {self._header_timeout_s:g} s")

    def _drop(self, detail: str) -> None:
        """Close a connection owing a request head: with a 408 if part of it came."""
        if self._head_bytes:
            self._refuse(408, detail)
        else:
            self.first_heads.pop(self, None)
            self.transport.close()

    def _refuse(self, status: int, detail: str) -> None:
        """Write a whole error response straight to the connection, and close it."""
        self.first_heads.pop(self, None)
        body = self.errors.body(status, detail)
        head = [
            b"HTTP/1.1 %d %s" % (status, _REASONS[status]),
            b"content-type: application/json",
            b"content-length: " + str(len(body)).encode(),
            b"connection: close",
            *(name + b": " + value for name, value in self.errors.headers),
        ]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        self.transport.close()

    async def _shed(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI app of a connection over max_connections: 503, then close."""
        body = self.errors.body(
            503,
            f"too many connections: this server serves {self.limits.max_connections} at "
            "once; retry",
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(SHED_RETRY_AFTER_S).encode()),
            (b"connection", b"close"),
            *self.errors.headers,
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


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


def guarded_protocol(limits: HttpLimits, errors: ErrorResponses) -> type[GuardedProtocol]:
    """The protocol class for uvicorn's `http=`; GuardUnavailable when the installed
    uvicorn lacks what the guard relies on."""
    import uvicorn

    base = _uvicorn_protocol()
    missing = _missing_members(base)
    if missing:
        raise GuardUnavailable(
            f"uvicorn {uvicorn.__version__}'s {base.__name__} lacks {', '.join(missing)}, "
            "which output_rate_core/http_guard.py relies on (written against uvicorn 0.54.0)"
        )
    parser = "httptools" if "httptools" in base.__module__ else "h11"
    attributes = {"limits": limits, "parser": parser, "errors": errors, "first_heads": {}}
    return type(f"Guarded{base.__name__}", (GuardedProtocol, base), attributes)
