"""The one place push sockets are made: CURVE, size limits, linger=0 on close."""

from __future__ import annotations

import zmq

from output_rate_core.protocol import MAX_MESSAGE_BYTES

# Environment variable an engine reads its own CURVE secret key (Z85) from. The
# control plane admits only the public keys it lists (OUTPUT_RATE_ZMQ_CLIENT_KEYS).
ENGINE_SECRET_KEY_ENV = "OUTPUT_RATE_ENGINE_SECRET_KEY"


def make_socket(
    context: zmq.Context,
    socket_type: int,
    *,
    server_secret_key: str | None = None,
    server_public_key: str | None = None,
    client_secret_key: str | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
) -> zmq.Socket:
    """A socket with the project's options.

    ``server_secret_key`` makes it a CURVE server. ``server_public_key`` makes
    it a CURVE client of that server, with ``client_secret_key`` as its own
    identity (a throwaway key pair when None, which only a server that admits
    any client accepts). ZMQ drops the connection of a peer that sends a
    frame over ``max_message_bytes``.
    """
    sock = context.socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if server_secret_key is not None:
        sock.curve_secretkey = server_secret_key.encode()
        sock.curve_publickey = zmq.curve_public(server_secret_key.encode())
        sock.curve_server = True
    elif server_public_key is not None:
        if client_secret_key is None:
            public, secret = zmq.curve_keypair()
        else:
            secret = client_secret_key.encode()
            public = zmq.curve_public(secret)
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_serverkey = server_public_key.encode()
    return sock
