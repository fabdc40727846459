"""The connection guard of both HTTP servers (output_rate_core/http_guard.py) on its own,
under a real uvicorn with each of its HTTP/1.1 parsers: where a request head ends, and
what uvicorn it relies on. The servers' own tests drive it through `output-rate serve`
(tests/control_plane/test_http_limits.py) and vLLM (tests/e2e/test_identity.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from harness.http_clients import send_head_until_refused
from output_rate_core.http_guard import (
    ErrorResponses,
    GuardedProtocol,
    HttpLimits,
    _missing_members,
    guarded_protocol,
)

MAX_HEAD_BYTES = 4096


async def echo_app(scope: Any, receive: Any, send: Any) -> None:
    """Answers every request with the size of its body."""
    if scope["type"] != "http":
        return
    size = 0
    more = True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = json.dumps({"body_bytes": size}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _error_body(status: int, detail: str) -> bytes:
    return json.dumps({"status": status, "detail": detail}).encode()


@pytest.fixture(scope="module", params=["httptools", "h11"])
def address(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    limits = HttpLimits(header_timeout_s=5, idle_timeout_s=5, max_head_bytes=MAX_HEAD_BYTES)
    errors = ErrorResponses(_error_body)
    protocol: type[GuardedProtocol] = guarded_protocol(limits, errors)
    assert protocol.parser == "httptools"  # installed here
    if request.param == "h11":  # what a plain `pip install uvicorn` runs
        from uvicorn.protocols.http.h11_impl import H11Protocol

        attributes = {"limits": limits, "parser": "h11", "errors": errors, "first_heads": {}}
        protocol = type("GuardedH11Protocol", (GuardedProtocol, H11Protocol), attributes)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(echo_app, http=protocol, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])))
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join()


def _exchange(address: tuple[str, int], *pieces: bytes) -> bytes:
    """Send the pieces apart (each its own read on the server), then read one answer."""
    with socket.create_connection(address, timeout=10) as sock:
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(0.05)
        data = b""
        while b"}" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def _padded_head(size: int, body_bytes: int) -> bytes:
    start = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nX-Pad: " % body_bytes
    return start + b"p" * (size - len(start) - 4) + b"\r\n\r\n"


def test_a_head_of_exactly_the_bound_passes_and_one_byte_more_is_a_431(
    address: tuple[str, int],
) -> None:
    body = b"b" * 100_000  # in the same read as the head: never counted as head
    assert _status(_exchange(address, _padded_head(MAX_HEAD_BYTES, len(body)) + body)) == 200
    over = _exchange(address, _padded_head(MAX_HEAD_BYTES + 1, 0))
    assert _status(over) == 431
    assert json.loads(over.split(b"\r\n\r\n", 1)[1])["detail"] == (
        f"request head: over {MAX_HEAD_BYTES} bytes"
    )


def test_the_end_of_a_head_is_found_across_reads(address: tuple[str, int]) -> None:
    head = _padded_head(MAX_HEAD_BYTES, 3)
    for cut in (1, 2, 3):  # the empty line split between two reads
        assert _status(_exchange(address, head[:-cut], head[-cut:] + b"abc")) == 200


def test_empty_lines_before_the_request_line_end_no_head(address: tuple[str, int]) -> None:
    with socket.create_connection(address, timeout=10) as sock:
        num_sent, response = send_head_until_refused(
            sock, b"\r\n\r\nGET / HTTP/1.1\r\nX-Big: ", 8 * 2**20
        )
    assert num_sent < 4 * 2**20
    # h11 refuses leading empty lines itself (400) when they come in a read of their own;
    # httptools skips them, and the guard refuses the head.
    assert _status(response) in (0, 400, 431)


def test_every_request_of_a_connection_has_the_whole_bound(address: tuple[str, int]) -> None:
    head = _padded_head(MAX_HEAD_BYTES, 3)
    with socket.create_connection(address, timeout=10) as sock:
        for _ in range(3):
            sock.sendall(head + b"abc")
            response = b""
            while not response.endswith(b"}"):
                chunk = sock.recv(65536)
                assert chunk, response
                response += chunk
            assert _status(response) == 200, response


class RequestResponseCycle:
    """A request cycle of a uvicorn that no longer tracks whether the body has come."""

    def __init__(self) -> None:
        self.response_complete = False
        self.response_started = False
        self.waiting_for_100_continue = False


class OtherProtocol(asyncio.Protocol):
    """An HTTP protocol without uvicorn's response hook."""

    def __init__(self) -> None:
        self.app = self.cycle = self.flow = self.loop = None
        self.connections: set[object] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport


def test_the_guard_checks_what_it_uses_of_uvicorn() -> None:
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert _missing_members(H11Protocol) == []
    assert _missing_members(HttpToolsProtocol) == []
    assert _missing_members(OtherProtocol) == [
        "protocol methods.on_response_complete",
        "RequestResponseCycle.more_body",
    ]
