"""A push server a test drives frame by frame: a real ZMQ ROUTER socket on 127.0.0.1,
so every fault (a gap, a duplicate, garbage, a lost tail, silence) is exact."""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from output_rate_core import protocol as p

WAIT_S = 15.0


class ScriptedServer:
    def __init__(self, secret_key: str | None = None, address: str = "tcp://127.0.0.1:0") -> None:
        # Called while waiting: the engine thread's part of a test engine.
        self.pump: Callable[[], object] = lambda: None
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if secret_key is not None:
            self.sock.curve_secretkey = secret_key.encode()
            self.sock.curve_server = True
        self.sock.ipv6 = address.startswith("tcp://[")
        self.sock.bind(address)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def recv(self, kind: type[p.Message], timeout_s: float = WAIT_S) -> tuple[bytes, p.Message]:
        """The next message of this kind (others, e.g. heartbeats, are skipped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.pump()
            if self.sock.poll(20):
                identity, frame = self.sock.recv_multipart()
                message = p.decode(frame)
                if isinstance(message, kind):
                    return identity, message
        raise AssertionError(f"no {kind.__name__} within {timeout_s}s")

    def send(self, identity: bytes, message: p.Message | bytes) -> None:
        frame = message if isinstance(message, bytes) else p.encode(message)
        self.sock.send_multipart([identity, frame])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.context.term()
