"""The API edge: what every HTTP request goes through before any route sees it.

- A request with a body is authenticated before one byte of the body is read (401/403
  come first, whatever the body), and its body is capped: MAX_BODY_BYTES, or
  MAX_BULK_BODY_BYTES for POST /limits:bulk; over that: 413, from the Content-Length
  header alone when there is one, else as soon as the streamed body passes the cap. A
  body cut off by a disconnect (or the server's idle timeout, control_plane/http_server.py)
  runs nothing.
- A path that is not UTF-8 after percent-decoding is refused (400): decoding it with
  replacement characters would make two byte strings one user.
- Every response gets frame protection and nosniff; the admin UI (/ui/) also gets a
  Content-Security-Policy allowing only its own origin (its token sits in localStorage).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote_to_bytes

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from control_plane.auth import PRINCIPAL_KEY, authenticate, check_can_write
from control_plane.deps import app_state

# Single-object bodies (a limit, a tier, a token name) are well under 2 KiB.
MAX_BODY_BYTES = 64 * 1024
# 10,000 bulk items of typical ids fit in ~1 MiB; the cap leaves room for long ids.
MAX_BULK_BODY_BYTES = 8 * 1024 * 1024
BULK_PATH = "/limits:bulk"
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

SECURITY_HEADERS = [
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
UI_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
UI_HEADERS = [(b"content-security-policy", UI_CSP.encode())]


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    """The connection closed before the whole body came (the client left, or the server
    timed it out): the request is dropped, never run on part of its body."""


def body_limit(path: str) -> int:
    return MAX_BULK_BODY_BYTES if path == BULK_PATH else MAX_BODY_BYTES


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _valid_path(scope: Scope) -> bool:
    raw = scope.get("raw_path")
    if not raw or (b"%" not in raw and raw.isascii()):
        return True
    try:
        unquote_to_bytes(raw.split(b"?", 1)[0]).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


async def _error(send: Send, status: int, detail: str, field: str | None, headers: Any) -> None:
    body = json.dumps({"detail": detail, "field": field}).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class EdgeGuard:
    """Pure ASGI middleware (see the module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra_headers = SECURITY_HEADERS + (UI_HEADERS if scope["path"].startswith("/ui") else [])

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *extra_headers]
            await send(message)

        if not _valid_path(scope):
            await _error(
                send_with_headers, 400, "path: not valid UTF-8 after percent-decoding", "path", {}
            )
            return
        length = _header(scope, b"content-length")
        has_body = (length is not None and length != "0") or (
            _header(scope, b"transfer-encoding") is not None
        )
        if not has_body:
            await self.app(scope, receive, send_with_headers)
            return
        limit = body_limit(scope["path"])
        try:
            principal = await authenticate(
                app_state(scope["app"]), _header(scope, b"authorization") or ""
            )
            if scope["method"] not in READ_METHODS:
                check_can_write(principal)
            if length is not None and length.isdigit() and int(length) > limit:
                raise BodyTooLarge
            body = await _read_body(receive, limit)
        except HTTPException as e:
            # Close: the body is never read, so this connection carries no next request.
            headers = {**(e.headers or {}), "connection": "close"}
            await _error(send_with_headers, e.status_code, str(e.detail), None, headers)
            return
        except ClientGone:
            # Nobody reads this answer; it is what the request counts as in /metrics.
            detail = "body: the connection closed before the whole body came"
            await _error(send_with_headers, 408, detail, "body", {"connection": "close"})
            return
        except BodyTooLarge:
            detail = f"body: over {limit} bytes (the limit of {scope['method']} {scope['path']})"
            if limit != MAX_BULK_BODY_BYTES:
                detail += f"; POST {BULK_PATH} takes up to {MAX_BULK_BODY_BYTES}"
            await _error(send_with_headers, 413, detail, "body", {"connection": "close"})
            return
        scope.setdefault("state", {})[PRINCIPAL_KEY] = principal
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send_with_headers)


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)
