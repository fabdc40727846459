"""The engine's HTTP connections in header and api-key mode (docs/identity.md, "The
server's connections").

In those modes vLLM's API server faces callers (in api-key mode directly), and before the
identity middleware sees a request, uvicorn has read its whole head: vLLM's uvicorn bounds
a head's size only with its h11 parser (``--h11-max-incomplete-event-size``), while
uvicorn runs httptools when it is installed, and it times out neither a head nor a body
that never ends. So the plugin runs the control plane's connection guard
(output_rate_core/http_guard.py) as uvicorn's protocol, through a row of
``vllm_compat.HTTP_GUARD_PATCHES`` (the API server's ``serve_http``, which hands its
keyword arguments to ``uvicorn.Config``):

- a head over vLLM's own ``--h11-max-incomplete-event-size`` (default 4 MiB), with either
  parser, is a 431 and its connection closed, the rest unread;
- ``--output-rate-http-header-timeout`` and ``--output-rate-http-idle-timeout`` (10 s
  each): the head's time, and a pause in a body or in reading a response.

The number of connections is not bounded here: an engine serves as many streams as its
operator lets vLLM take, and the guard's answers carry OpenAI's error shape.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from engine_ext.identity import IdentityConfig, IdentityRefused
from output_rate_core.http_guard import ErrorResponses, GuardedProtocol, HttpLimits
from output_rate_core.http_guard import guarded_protocol as guard

logger = logging.getLogger("vllm.output_rate." + __name__)

# What vLLM's serve_http passes to uvicorn as its h11 parser's bound on a head.
HEAD_BOUND_KWARG = "h11_max_incomplete_event_size"
_CODES = {408: "request_timeout", 431: "request_header_too_large"}


def _error_body(status: int, detail: str) -> bytes:
    return IdentityRefused(status, detail, code=_CODES[status]).body()


def guarded_protocol(config: IdentityConfig, max_head_bytes: int) -> type[GuardedProtocol]:
    limits = HttpLimits(
        header_timeout_s=config.header_timeout_s,
        idle_timeout_s=config.idle_timeout_s,
        max_head_bytes=max_head_bytes,
    )
    protocol = guard(limits, ErrorResponses(_error_body))
    logger.info(
        "output-rate: HTTP request heads of at most %d bytes (--h11-max-incomplete-event-size) "
        "within %g s (--output-rate-http-header-timeout); bodies and response reads may "
        "pause %g s (--output-rate-http-idle-timeout); parser %s",
        limits.max_head_bytes,
        limits.header_timeout_s,
        limits.idle_timeout_s,
        protocol.parser,
    )
    return protocol


def wrap_serve_http(original: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """vLLM's API server ``serve_http``, with the guard as uvicorn's protocol in the
    identity modes (``IDENTITY_ENV``, set by the plugin while parsing the flags)."""

    async def serve_http(app: Any, sock: Any, *args: Any, **uvicorn_kwargs: Any) -> Any:
        config = IdentityConfig.from_env()
        if config.mode != "body":
            max_head_bytes = int(uvicorn_kwargs[HEAD_BOUND_KWARG])
            uvicorn_kwargs["http"] = guarded_protocol(config, max_head_bytes)
        return await original(app, sock, *args, **uvicorn_kwargs)

    return serve_http
