"""A real `output-rate serve` against silent, slow, oversized and flooding clients
(control_plane/http_server.py): the header size bound and the header and idle timeouts on
both of uvicorn's HTTP/1.1 parsers, the connection bounds derived from a lowered
open-file limit, and writes that go on through it all."""

from __future__ import annotations

import json
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from control_plane.errors import ConfigurationError
from control_plane.http_server import DEFAULT_MAX_CONNECTIONS, http_limits
from control_plane.settings import Settings
from harness.control_plane import ADMIN_TOKEN, Served, fresh_database, serve
from harness.http_clients import send_head_until_refused
from output_rate_core.http_guard import SHED_HEADER_TIMEOUT_S

HEADER_S = 2.0
IDLE_S = 2.0
MAX_HEADER_BYTES = 16 * 1024
# Closed within the timeout and this, on two shared cores.
SLACK_S = 3.0
TIMEOUTS = {
    "OUTPUT_RATE_HTTP_HEADER_TIMEOUT_S": str(HEADER_S),
    "OUTPUT_RATE_HTTP_IDLE_TIMEOUT_S": str(IDLE_S),
    "OUTPUT_RATE_HTTP_KEEP_ALIVE_TIMEOUT_S": "1",
    "OUTPUT_RATE_HTTP_MAX_HEADER_BYTES": str(MAX_HEADER_BYTES),
}
AUTH = f"Authorization: Bearer {ADMIN_TOKEN}\r\n".encode()
# uvicorn's parser -> how the server is started: as installed (httptools, which this
# environment has), or as a plain `pip install uvicorn` would run it (h11 only).
PARSERS: dict[str, tuple[str, ...]] = {
    "httptools": ("-m", "control_plane.cli"),
    "h11": (
        "-c",
        "import runpy, sys; sys.modules['httptools'] = None; "
        "runpy.run_module('control_plane.cli', run_name='__main__', alter_sys=True)",
    ),
}
LOW_FILES = 256


def _address(served: Served) -> tuple[str, int]:
    host, port = served.url.removeprefix("http://").split(":")
    return host, int(port)


def _connect(served: Served) -> socket.socket:
    return socket.create_connection(_address(served), timeout=30)


def _read_until_closed(sock: socket.socket, start: float) -> tuple[float, bytes]:
    """Everything the server sends, and the seconds from `start` until it closed."""
    sock.settimeout(HEADER_S + IDLE_S + 4 * SLACK_S)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        except TimeoutError:
            return float("inf"), data
        if not chunk:
            break
        data += chunk
    return time.monotonic() - start, data


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def _body(response: bytes) -> dict[str, object]:
    body: dict[str, object] = json.loads(response.split(b"\r\n\r\n", 1)[1])
    return body


@pytest.fixture(scope="module", params=list(PARSERS))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp(f"http-{request.param}")
    with (
        fresh_database("sqlite", tmp) as url,
        serve(url, tmp, env=TIMEOUTS, python_args=PARSERS[request.param]) as s,
    ):
        assert f"({request.param})" in s.log.read_text(), s.log.read_text()
        yield s


def _silent(sock: socket.socket) -> None:
    pass


def _half_head(sock: socket.socket) -> None:
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")


def _slowloris(sock: socket.socket) -> None:
    """A head that never ends, one header line at a time, each well within the timeout."""
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")

    def trickle() -> None:
        try:
            for i in range(int(4 * (HEADER_S + SLACK_S))):
                time.sleep(0.25)
                sock.sendall(f"x-{i}: y\r\n".encode())
        except OSError:
            pass  # closed by the server

    threading.Thread(target=trickle, daemon=True).start()


def _stalled_body(sock: socket.socket) -> None:
    # A valid body that is not the whole declared length: it must not be applied.
    body = b'{"output_tokens_per_second": 5}'
    sock.sendall(
        b"PUT /limits/stalled HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Type: application/json"
        b"\r\nContent-Length: " + str(len(body) + 10).encode() + b"\r\n\r\n" + body
    )


def _stalled_chunked_body(sock: socket.socket) -> None:
    sock.sendall(
        b"PUT /limits/stalled-chunked HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Type: "
        b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n1f\r\n"
        b'{"output_tokens_per_second": 5}\r\n'
    )


def _half_head_after_a_response(sock: socket.socket) -> None:
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    response = b""
    while not response.endswith(b'{"status":"ok"}'):
        response += sock.recv(65536)
    sock.sendall(b"GET /healthz HTTP/1.1\r\n")


# what the client does -> (the timeout that closes it, the status it gets (0: none), what
# the error names)
SLOW_CLIENTS: dict[str, tuple[Callable[[socket.socket], None], float, int, str]] = {
    "silent": (_silent, HEADER_S, 0, ""),
    "half head": (_half_head, HEADER_S, 408, "request head"),
    "slowloris": (_slowloris, HEADER_S, 408, "request head"),
    "stalled body": (_stalled_body, IDLE_S, 408, "request body"),
    "stalled chunked body": (_stalled_chunked_body, IDLE_S, 408, "request body"),
    "half head after a response": (_half_head_after_a_response, HEADER_S, 408, "request head"),
}


def test_silent_and_slow_clients_are_closed_within_the_timeouts(served: Served) -> None:
    def run(name: str) -> tuple[str, float, bytes]:
        act = SLOW_CLIENTS[name][0]
        with _connect(served) as sock:
            start = time.monotonic()
            act(sock)
            return (name, *_read_until_closed(sock, start))

    with ThreadPoolExecutor(len(SLOW_CLIENTS)) as pool:
        results = list(pool.map(run, SLOW_CLIENTS))
    for name, closed_after, response in results:
        _, timeout, status, names = SLOW_CLIENTS[name]
        assert timeout / 2 <= closed_after <= timeout + SLACK_S, (name, closed_after)
        last = response[response.rfind(b"HTTP/1.1 ") :] if response else b""
        assert _status(last) == status, (name, response)
        if status:
            assert str(_body(last)["detail"]).startswith(names), (name, response)
    with served.client() as c:
        # The parts of bodies that came were never applied.
        for user in ("stalled", "stalled-chunked"):
            assert c.get(f"/limits/{user}").json()["source"] == "default"


def test_an_oversized_request_head_is_refused_before_it_is_read(served: Served) -> None:
    # Before the bound, the server read a 93 MiB head whole within its head timeout.
    total = 64 * 2**20
    with _connect(served) as sock:
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + AUTH + b"X-Big: "
        num_sent, response = send_head_until_refused(sock, head, total)
    print(f"{served.log.name}: an endless head refused after {num_sent} bytes sent")
    # The socket buffers on both sides hold some MiB; the server read no more than the bound.
    assert num_sent < total / 4, num_sent
    # The answer comes unless the close (with the head's rest unread) reset it away first.
    if response:
        assert _status(response) == 431, response
        assert str(_body(response)["detail"]).startswith("request head: over 16384 bytes")
    # A head just under the bound, sent at once with its body, is served.
    body = b'{"output_tokens_per_second": 9}'
    padding = b"X-Pad: " + b"p" * (MAX_HEADER_BYTES - 400) + b"\r\n"
    put = (
        b"PUT /limits/big-head HTTP/1.1\r\nHost: x\r\n"
        + AUTH
        + padding
        + b"Content-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
    )
    assert len(put) <= MAX_HEADER_BYTES
    with _connect(served) as sock:
        response = _request(sock, put, body)
        assert _status(response) == 200, response
        # The bound is per request: the next head on the connection counts from zero.
        assert _status(_request(sock, put, body)) == 200


def _request(sock: socket.socket, head: bytes, body: bytes = b"") -> bytes:
    """Send one request (in pieces when `head` or `body` are lists) and read its response."""
    sock.sendall(head + body)
    return _response(sock)


def _response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk
        rest += chunk
    return head + b"\r\n\r\n" + rest


def test_a_client_that_keeps_talking_is_not_cut(served: Served) -> None:
    put = b"PUT /limits/talker HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Type: application/json"
    with _connect(served) as sock:
        # Requests back to back for longer than every timeout, pausing under keep-alive.
        start = time.monotonic()
        num_answered = 0
        while time.monotonic() - start < HEADER_S + IDLE_S + 1:
            response = _request(sock, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _status(response) == 200
            num_answered += 1
            time.sleep(0.2)
        assert num_answered >= 10
        # A head in pieces, complete within the header timeout; a body whose pieces come
        # under the idle timeout apart, longer in all than that timeout.
        body = b'{"output_tokens_per_second": 7}'
        sock.sendall(put[:20])
        time.sleep(HEADER_S / 4)
        sock.sendall(put[20:] + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        for i in range(0, len(body), 10):
            time.sleep(IDLE_S / 2)
            sock.sendall(body[i : i + 10])
        response = _response(sock)
        assert _status(response) == 200, response
        assert _body(response)["output_tokens_per_second"] == 7
        # Still the same connection.
        assert _status(_request(sock, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")) == 200


def test_a_client_that_stops_reading_its_response_is_dropped(served: Served) -> None:
    with served.client() as c:
        long_ids = [f"{i:04d}-" + "u" * 240 for i in range(1000)]
        items = [{"user": user, "output_tokens_per_second": 5} for user in long_ids]
        assert c.post("/limits:bulk", json={"items": items}).status_code == 200
        num_page_bytes = len(c.get("/limits?limit=1000").content)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(_address(served))
    with sock:
        # Pipelined, more than the socket buffers on both sides hold; then nothing is read.
        num_requests = 20
        start = time.monotonic()
        sock.sendall(b"GET /limits?limit=1000 HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n" * 1)
        sock.sendall(
            (b"GET /limits?limit=1000 HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n")
            * (num_requests - 1)
        )
        time.sleep(IDLE_S + SLACK_S)
        closed_after, responses = _read_until_closed(sock, start)
    assert responses.startswith(b"HTTP/1.1 200 ")
    assert len(responses) < num_requests * num_page_bytes
    assert closed_after <= 2 * (IDLE_S + SLACK_S)


def _limited_settings() -> Settings:
    return Settings(_env_file=None)  # type: ignore[call-arg]


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def limited(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """A server whose open-file limit is LOW_FILES (soft and hard: it cannot raise it)."""

    def low_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (LOW_FILES, LOW_FILES))

    # This process opens more sockets than that.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    tmp = tmp_path_factory.mktemp(f"limited-{request.param}")
    env = {**TIMEOUTS, "OUTPUT_RATE_HTTP_KEEP_ALIVE_TIMEOUT_S": "5"}
    with (
        fresh_database(request.param, tmp) as url,
        serve(url, tmp, env=env, preexec_fn=low_files) as s,
    ):
        log = s.log.read_text()
        limits = http_limits(_limited_settings(), LOW_FILES)
        assert f"open-file limit {LOW_FILES}\n" in log, log
        assert f"at most {limits.max_connections} connections" in log, log
        yield s
        for bad in ("Traceback", "unable to open", "Too many open files", "500 Internal"):
            assert bad not in s.log.read_text(), s.log.read_text()


def _num_closed(socks: list[socket.socket], wait_s: float, enough: int | None = None) -> int:
    """How many of `socks` the server has closed, waiting at most `wait_s` for all of
    them (or for `enough`)."""
    closed: set[socket.socket] = set()
    deadline = time.monotonic() + wait_s
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        target = len(socks) if enough is None else enough
        while len(closed) < target and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(timeout=left):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                if not data:
                    closed.add(sock)
                    selector.unregister(sock)
    return len(closed)


def test_idle_sockets_beyond_the_file_limit_lock_nobody_out(limited: Served) -> None:
    limits = http_limits(_limited_settings(), LOW_FILES)
    num_idle = LOW_FILES + 44
    with limited.client() as admin:
        assert admin.get("/healthz").status_code == 200  # a connection open before
        idle = [_connect(limited) for _ in range(num_idle)]
        # The server closes a silent socket HEADER_S after it opened: the newest one is
        # open until then.
        newest_opened = time.monotonic()
        try:
            # The server makes room for talking clients by closing silent ones.
            num_dropped = num_idle - limits.max_connections
            assert _num_closed(idle, 1.0, enough=num_dropped) >= num_dropped
            # A new client is served, an authenticated write on a new connection too.
            assert httpx.get(f"{limited.url}/healthz", timeout=5).status_code == 200
            with limited.client() as fresh:
                put = fresh.put("/limits/fresh", json={"output_tokens_per_second": 3})
                assert put.status_code == 200, put.text
            # A bulk import on the connection opened before (before: a 500), sent while
            # the newest idle sockets are still open (with a quarter of the timeout to spare).
            assert time.monotonic() - newest_opened < HEADER_S * 3 / 4
            items = [{"user": f"bulk-{i}", "output_tokens_per_second": 4} for i in range(2000)]
            bulk = admin.post("/limits:bulk", json={"items": items})
            assert bulk.status_code == 200, bulk.text
            assert bulk.json()["num_changed"] == 2000
            # Then every idle socket is gone within the header timeout.
            assert _num_closed(idle, HEADER_S + SLACK_S) == num_idle
        finally:
            for sock in idle:
                sock.close()
        assert admin.get("/limits?limit=1").json()["total"] == 2001
        assert admin.get("/limits/bulk-1999").json()["output_tokens_per_second"] == 4


def test_when_every_connection_has_spoken_a_new_one_gets_503(limited: Served) -> None:
    limits = http_limits(_limited_settings(), LOW_FILES)
    talked: list[socket.socket] = []
    try:
        # Every connection the server serves: each has sent a request and is kept alive.
        for _ in range(limits.max_connections):
            sock = _connect(limited)
            talked.append(sock)
            _request(sock, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        with _connect(limited) as sock:
            start = time.monotonic()
            response = _request(sock, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert time.monotonic() - start < 1.0
        assert _status(response) == 503
        assert b"\r\nretry-after: 1\r\n" in response.lower()
        assert "too many connections" in str(_body(response)["detail"])
        # A silent one over the bound is closed sooner than the header timeout, and a
        # flood beyond what the files allow is closed at once.
        flood = [_connect(limited) for _ in range(LOW_FILES)]
        try:
            assert _num_closed(flood, SHED_HEADER_TIMEOUT_S + SLACK_S) == len(flood)
        finally:
            for sock in flood:
                sock.close()
        # Connections that have spoken are never dropped for new ones.
        assert _status(_request(talked[0], b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")) == 200
    finally:
        for sock in talked:
            sock.close()
    deadline = time.monotonic() + SLACK_S
    while httpx.get(f"{limited.url}/healthz", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


# open-file limit -> (connections served, connections open at all)
BOUNDS = {
    64: (28, 32),
    256: (112, 128),
    1024: (672, 768),
    1 << 20: (DEFAULT_MAX_CONNECTIONS, 2 * DEFAULT_MAX_CONNECTIONS),
}


def test_the_bounds_follow_the_open_file_limit() -> None:
    for num_files, (max_connections, max_open) in BOUNDS.items():
        limits = http_limits(_limited_settings(), num_files)
        assert (limits.max_connections, limits.max_open) == (max_connections, max_open)
    set_ = Settings(http_max_connections=100, _env_file=None)  # type: ignore[call-arg]
    assert http_limits(set_, 1024).max_connections == 100
    assert http_limits(set_, 1024).max_open == 200
    too_many = Settings(http_max_connections=769, _env_file=None)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="OUTPUT_RATE_HTTP_MAX_CONNECTIONS=769"):
        http_limits(too_many, 1024)
    with pytest.raises(ConfigurationError, match="open-file limit is 63"):
        http_limits(_limited_settings(), 63)


def test_serve_raises_its_open_file_limit_and_says_so(tmp_path: Path) -> None:
    def soft_1000() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1000, hard), hard))

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with fresh_database("sqlite", tmp_path) as url, serve(url, tmp_path, preexec_fn=soft_1000) as s:
        log = s.log.read_text()
        pid = s.process.pid
        limits = (Path(f"/proc/{pid}/limits")).read_text()
    if hard > 1000:
        assert f"open-file limit {hard} (raised from 1000)" in log, log
    assert f"{hard}" in next(line for line in limits.splitlines() if "open files" in line)
