"""A TCP proxy between one process and its database, to cut the link the ways a network
or a database administrator does: terminated sessions that may not come back, a refused
port, a black hole. Real sockets on 127.0.0.1, one thread per direction of a connection."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from collections.abc import Callable
from typing import Literal

from harness.servers import free_port

Cut = Literal["terminate", "refuse", "blackhole"]


class TcpProxy:
    """Listens on a free port of 127.0.0.1 and forwards to ``target`` (host, port).

    ``cut("terminate")``: ``terminate(ports)`` ends the sessions of the proxy's upstream
    connections (their local ports; e.g. pg_terminate_backend by client_port) and new
    connections are closed at once; ``cut("refuse")``: nothing listens any more and every
    connection is closed; ``cut("blackhole")``: connections stay open and new ones are
    accepted, but no byte goes through either way. ``restore()`` forwards again (on the
    same port)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._lock = threading.Lock()
        self._cut: Cut | None = None
        # (client socket, upstream socket) of every open connection
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._flowing = threading.Event()
        self._flowing.set()
        self._listen()

    def _listen(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        listener.settimeout(0.1)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while not self._stop.is_set() and self._listener is listener:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._cut == "terminate":
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._pairs.append((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        try:
            selector.register(src, selectors.EVENT_READ)
            while not self._stop.is_set():
                self._flowing.wait()
                if not selector.select(0.1):
                    continue
                if not self._flowing.is_set():
                    continue  # black-holed: what arrived waits (and never goes)
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            selector.close()
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def upstream_ports(self) -> list[int]:
        with self._lock:
            return [upstream.getsockname()[1] for _, upstream in self._pairs]

    def cut(self, how: Cut, terminate: Callable[[list[int]], None] | None = None) -> None:
        self._cut = how
        if how == "blackhole":
            self._flowing.clear()
        elif how == "refuse":
            listener, self._listener = self._listener, None
            if listener is not None:
                listener.close()
            self._close_all()
        else:
            assert terminate is not None, "terminate needs the database's way to end sessions"
            terminate(self.upstream_ports())

    def restore(self) -> None:
        cut, self._cut = self._cut, None
        self._flowing.set()
        if cut == "refuse":
            self._listen()

    def close(self) -> None:
        self._stop.set()
        self._flowing.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        self._close_all()

    def _close_all(self) -> None:
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
