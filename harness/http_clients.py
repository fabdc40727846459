"""Hostile HTTP/1.1 clients on a raw socket, for the servers' connection guards
(output_rate_core/http_guard.py): a head that never ends, sent as fast as the server
takes it or one line at a time."""

from __future__ import annotations

import select
import socket
import threading
import time

CHUNK_BYTES = 256 * 1024


def send_head_until_refused(
    sock: socket.socket, head_start: bytes, total: int, *, timeout_s: float = 60
) -> tuple[int, bytes]:
    """Send `head_start`, then header bytes without an end, until `total` bytes are sent or
    the server answers or closes. Returns (the bytes sent, what the server sent back:
    nothing when its close reset the connection before the answer was read)."""
    sock.settimeout(timeout_s)
    # What this side's kernel holds counts as sent: keep it small.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CHUNK_BYTES)
    filler = b"a" * CHUNK_BYTES
    num_sent = 0
    piece = head_start
    try:
        while num_sent < total:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            sock.sendall(piece)
            num_sent += len(piece)
            piece = filler
    except (BrokenPipeError, ConnectionResetError):
        pass
    return num_sent, seconds_until_closed(sock, time.monotonic(), timeout_s=timeout_s)[1]


def trickle_head(
    sock: socket.socket, head_start: bytes, *, interval_s: float, num_lines: int
) -> None:
    """A head that never ends, one header line every `interval_s` (each well within any
    timeout), on a thread of its own until the server closes."""

    def trickle() -> None:
        try:
            sock.sendall(head_start)
            for i in range(num_lines):
                time.sleep(interval_s)
                sock.sendall(f"x-{i}: y\r\n".encode())
        except OSError:
            pass  # closed by the server

    threading.Thread(target=trickle, daemon=True).start()


def seconds_until_closed(
    sock: socket.socket, start: float, *, timeout_s: float
) -> tuple[float, bytes]:
    """Everything the server sends, and the seconds from `start` until it closed
    (infinity if it is still open after `timeout_s`)."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        return float("inf"), data
    return time.monotonic() - start, data
