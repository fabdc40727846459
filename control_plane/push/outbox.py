"""The single send path of the push server to engines."""

from __future__ import annotations

import zmq


class Outbox:
    """Frames to engines over the ROUTER socket (the socket thread only; the tests'
    fault-injection seam). The server hands it the socket once it is bound."""

    def __init__(self) -> None:
        self.router: zmq.Socket | None = None
        # Frames not queued because the peer's queue was full (it does not read).
        self.num_frames_unsent = 0

    def send(self, identity: bytes, frame: bytes) -> bool:
        """Whether the frame was queued. Not when the peer's queue is full (it does not
        read: its heartbeat will show the gap and it resyncs) or the peer is gone."""
        assert self.router is not None, "sent before the server started"
        try:
            self.router.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.Again:
            self.num_frames_unsent += 1
            return False
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            return False
        return True
