"""Who a request is, in the API server (docs/identity.md): ``--output-rate-identity``.

- ``body`` (the default): ``vllm_xargs.output_rate_user`` as the caller wrote it. No
  middleware; the plugin logs once that identities are not authenticated.
- ``header``: the value of ``--output-rate-identity-header``, set by a gateway in front.
- ``api-key``: the user of the ``Authorization: Bearer`` key, from the keys the control
  plane pushes to this API server (engine_ext/key_client.py).

In the last two, ``IdentityMiddleware`` (pure ASGI, added through vLLM's own
``--middleware`` list, outermost) decides the user from the headers before any byte of
the body is read, answers a request without a valid identity itself (OpenAI's error
shape), and rewrites the JSON body so that ``vllm_xargs.output_rate_user`` (and
``sampling_params.extra_args.output_rate_user`` of the token-in API) is that user,
whatever the body said. Everything downstream (scheduler, usage, metrics, fleet) reads
the user only from there.

Every path is guarded except the probes (``PROBE_PATHS``): not only ``/v1``, because
vLLM also generates at ``/invocations`` (SageMaker) and ``/inference/v1/generate``,
which take the same bodies. The few paths whose requests cannot carry a user (the
release's ``no_user_paths`` in engine_ext/vllm_compat.py, e.g. ``/v1/systemone``, and
from vLLM 0.33 ``/v1/decisions``) are refused (403) after authentication: served, they
would be charged to '__anonymous__' whoever sent them. OPTIONS requests (CORS
preflights) pass.

The settings reach every API server process through ``IDENTITY_ENV``, which the plugin
sets while parsing the flags (extra API server processes inherit it).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from engine_ext import vllm_compat
from engine_ext.limiter import ANONYMOUS_USER, USER_ARG
from output_rate_core.ids import check_user_id

if TYPE_CHECKING:
    from engine_ext.key_client import KeyClient

logger = logging.getLogger("vllm.output_rate." + __name__)

Mode = Literal["body", "header", "api-key"]
Missing = Literal["refuse", "anonymous"]
MODES: tuple[Mode, ...] = ("body", "header", "api-key")
MISSING_POLICIES: tuple[Missing, ...] = ("refuse", "anonymous")
IDENTITY_ENV = "VLLM_OUTPUT_RATE_IDENTITY"
MIDDLEWARE = "engine_ext.identity.IdentityMiddleware"
# A body over this is refused (413) rather than passed on unread: the user it names
# could not be overwritten. vLLM's own limit on prompts is far below it.
MAX_BODY_BYTES = 32 * 1024 * 1024
# Paths that answer probes and generate nothing (and /metrics/..., a mounted app).
PROBE_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})
VLLM_XARGS = "vllm_xargs"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class IdentityConfig:
    mode: Mode = "body"
    # header mode: the header a gateway sets, and what a request without it gets
    header: str | None = None
    missing: Missing = "refuse"
    # api-key mode: where the keys come from (the control plane's replicas; the engine's
    # base id, role "api")
    control_plane_endpoints: tuple[str, ...] = ()
    engine_id: str | None = None
    model: str = ""
    control_plane_public_key: str | None = None

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    def __post_init__(self) -> None:
        # JSON gives a list back.
        object.__setattr__(self, "control_plane_endpoints", tuple(self.control_plane_endpoints))

    @classmethod
    def from_env(cls, environ: MutableMapping[str, str] | None = None) -> IdentityConfig:
        text = (os.environ if environ is None else environ).get(IDENTITY_ENV)
        return cls(**json.loads(text)) if text else cls()


class IdentityRefused(Exception):
    """A request that gets no identity: answered with ``status`` and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type = type_
        self.param = param
        self.headers = headers

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.type, "param": self.param}
        return json.dumps({"error": {**error, "code": self.code}}).encode()


def _with_user(value: object, user: str, *, field: str) -> dict[str, Any]:
    if value is None:
        return {USER_ARG: user}
    if not isinstance(value, dict):
        raise IdentityRefused(
            400, f"{field} must be a JSON object", code="invalid_type", param=field
        )
    return {**value, USER_ARG: user}


def rewrite_body(body: bytes, user: str) -> bytes | None:
    """``body`` with ``user`` as the request's user, or None when it is no JSON object
    (it then carries no user downstream either, and is passed on as it is)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    data[VLLM_XARGS] = _with_user(data.get(VLLM_XARGS), user, field=VLLM_XARGS)
    # The token-in API (/inference/v1/generate) takes SamplingParams as they are.
    params = data.get("sampling_params")
    if isinstance(params, dict):
        field = "sampling_params.extra_args"
        params["extra_args"] = _with_user(params.get("extra_args"), user, field=field)
    return json.dumps(data, separators=(",", ":")).encode()


def _header_values(scope: Scope, name: bytes) -> list[bytes]:
    return [value for key, value in scope.get("headers", ()) if key.lower() == name]


def _route_path(scope: Scope) -> str:
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def is_guarded(scope: Scope) -> bool:
    if scope.get("method") == "OPTIONS":
        return False
    path = _route_path(scope)
    return path not in PROBE_PATHS and not path.startswith("/metrics/")


async def _answer(refused: IdentityRefused, scope: Scope, send: Send) -> None:
    if scope["type"] == "websocket":
        # Before accept, a close is answered with HTTP 403 by the server.
        await send({"type": "websocket.close", "code": 1008, "reason": refused.code})
        return
    body = refused.body()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *refused.headers,
    ]
    await send({"type": "http.response.start", "status": refused.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class IdentityMiddleware:
    """Pure ASGI: the user from the header or API key, written into the body."""

    def __init__(
        self, app: App, config: IdentityConfig | None = None, key_client: KeyClient | None = None
    ) -> None:
        self.app = app
        self.config = IdentityConfig.from_env() if config is None else config
        self._header = (self.config.header or "").lower().encode("latin-1")
        # Paths that generate from a request of their own making, with no vllm_xargs: the
        # user could not reach the scheduler, so they would be charged to '__anonymous__'.
        self._no_user_paths = vllm_compat.release().no_user_paths
        self.key_client = key_client
        self._owns_key_client = False
        if self.config.mode == "api-key" and key_client is None:
            self.key_client = self._start_key_client()
            self._owns_key_client = True
        if self.config.mode == "header":
            logger.info(
                "output-rate: identity from the %s header (a request without it: %s)",
                self.config.header,
                self.config.missing,
            )

    def _start_key_client(self) -> KeyClient:
        from engine_ext.key_client import KeyClient

        config = self.config
        assert config.control_plane_endpoints and config.engine_id is not None
        client = KeyClient(
            endpoints=config.control_plane_endpoints,
            engine_id=config.engine_id,
            model=config.model,
            server_public_key=config.control_plane_public_key,
        )
        client.start()
        logger.info(
            "output-rate: identity from API keys (Authorization: Bearer), kept current from "
            "%s as engine %s",
            ",".join(config.control_plane_endpoints),
            config.engine_id,
        )
        return client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self.app(scope, self._lifespan_receive(receive), send)
            return
        if self.config.mode == "body" or kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if not is_guarded(scope):
            await self.app(scope, receive, send)
            return
        try:
            user = self._user_of(scope)
        except IdentityRefused as refused:
            await _answer(refused, scope, send)
            return
        if _route_path(scope) in self._no_user_paths:
            not_carried = IdentityRefused(
                403,
                f"{_route_path(scope)} cannot carry the caller's identity (it has no vllm_xargs) "
                f"and is not served with --output-rate-identity {self.config.mode}",
                code="identity_not_carried",
            )
            await _answer(not_carried, scope, send)
            return
        scope = self._without_credentials(scope)
        if kind == "websocket":
            await self.app(scope, receive, send)
            return
        await self._rewrite_and_call(scope, receive, send, user)

    def _lifespan_receive(self, receive: Receive) -> Receive:
        async def lifespan_receive() -> Message:
            message = await receive()
            if message.get("type") == "lifespan.shutdown" and self._owns_key_client:
                assert self.key_client is not None
                self.key_client.close()
            return message

        return lifespan_receive

    # ---- the user, from the headers only ----------------------------------

    def _user_of(self, scope: Scope) -> str:
        if self.config.mode == "api-key":
            return self._user_of_key(scope)
        return self._user_of_header(scope)

    def _user_of_key(self, scope: Scope) -> str:
        client = self.key_client
        assert client is not None
        if not client.has_snapshot:
            raise IdentityRefused(
                503,
                "API keys are not loaded yet (no answer from the control plane); retry shortly",
                code="keys_not_loaded",
                type_="server_error",
                headers=((b"retry-after", b"1"),),
            )
        values = _header_values(scope, b"authorization")
        if len(values) != 1:
            raise _bad_key("Missing API key: send it as 'Authorization: Bearer <key>'")
        scheme, _, key = values[0].decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise _bad_key("Missing API key: send it as 'Authorization: Bearer <key>'")
        found = client.table.user_of(key.strip())
        if found is None:
            raise _bad_key("Incorrect API key provided")
        key_id, user = found
        client.note_use(key_id)
        return str(user)

    def _user_of_header(self, scope: Scope) -> str:
        name = self.config.header
        values = _header_values(scope, self._header)
        if not values:
            if self.config.missing == "anonymous":
                return ANONYMOUS_USER
            raise IdentityRefused(
                401, f"missing the {name} header (the caller's identity)", code="missing_identity"
            )
        if len(values) > 1:
            raise IdentityRefused(
                400, f"the {name} header is given more than once", code="invalid_identity"
            )
        try:
            return check_user_id(values[0].decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            reason = "is not UTF-8" if isinstance(e, UnicodeDecodeError) else f"is invalid: {e}"
            raise IdentityRefused(
                400, f"the {name} header {reason}", code="invalid_identity"
            ) from None

    def _without_credentials(self, scope: Scope) -> Scope:
        """api-key mode: the key goes no further than this middleware."""
        if self.config.mode != "api-key":
            return scope
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"authorization"]
        return {**scope, "headers": headers}

    # ---- the body -----------------------------------------------------------

    async def _rewrite_and_call(
        self, scope: Scope, receive: Receive, send: Send, user: str
    ) -> None:
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # http.disconnect: the caller is gone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                refused = IdentityRefused(
                    413, f"request body over {MAX_BODY_BYTES} bytes", code="body_too_large"
                )
                await _answer(refused, scope, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if body:
            try:
                rewritten = rewrite_body(body, user)
            except IdentityRefused as refused:
                await _answer(refused, scope, send)
                return
            if rewritten is not None:
                body = rewritten
                headers = [
                    (k, v)
                    for k, v in scope.get("headers", ())
                    if k.lower() not in (b"content-length", b"transfer-encoding")
                ]
                headers.append((b"content-length", str(len(body)).encode()))
                scope = {**scope, "headers": headers}
        await self.app(scope, _replay(body, receive), send)


def _bad_key(message: str) -> IdentityRefused:
    return IdentityRefused(
        401, message, code="invalid_api_key", headers=((b"www-authenticate", b"Bearer"),)
    )


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body in one message, then the caller's own receive (for the disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
