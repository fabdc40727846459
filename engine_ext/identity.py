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

Every path is guarded except the probes (``PROBE_PATHS``; in api-key mode ``/health``
answers 503 while no keys are loaded): not only ``/v1``, because
vLLM also generates at ``/invocations`` (SageMaker) and ``/inference/v1/generate``,
which take the same bodies. The few paths whose requests cannot carry a user (the
release's ``no_user_paths`` in engine_ext/vllm_compat.py, e.g. ``/v1/systemone``, and
from vLLM 0.33 ``/v1/decisions``) are refused (403) after authentication: served, they
would be charged to '__anonymous__' whoever sent them. OPTIONS requests (CORS
preflights) pass.

In api-key mode a user's key opens only the users' routes (the release's
``tenant_paths``); every other route is the operator's and takes the operator key
(``OPERATOR_KEY_ENV``, its SHA-256 in the settings). In both modes a stored response
(the Responses API) is its user's: the middleware writes the ``request_id`` it is stored
under with a tag of the user (``response_id_prefix``), and a lookup, a cancel or a
``previous_response_id`` must name one of the caller's.

In api-key mode a key's running requests end when the key is revoked (cancelled, so
vLLM aborts them, within a step of the revocation's arrival).

The settings reach every API server process through ``IDENTITY_ENV``, which the plugin
sets while parsing the flags (extra API server processes inherit it).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from engine_ext import vllm_compat
from engine_ext.limiter import ANONYMOUS_USER, USER_ARG
from output_rate_core import protocol as p
from output_rate_core.http_guard import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_IDLE_TIMEOUT_S
from output_rate_core.ids import check_user_id

if TYPE_CHECKING:
    from engine_ext.key_client import KeyClient

logger = logging.getLogger("vllm.output_rate." + __name__)

Mode = Literal["body", "header", "api-key"]
Missing = Literal["refuse", "anonymous"]
MODES: tuple[Mode, ...] = ("body", "header", "api-key")
MISSING_POLICIES: tuple[Missing, ...] = ("refuse", "anonymous")
IDENTITY_ENV = "VLLM_OUTPUT_RATE_IDENTITY"
# api-key mode: the operator's credential, for the routes no user's key opens.
OPERATOR_KEY_ENV = "OUTPUT_RATE_OPERATOR_KEY"
MIN_OPERATOR_KEY_LEN = 32
# The OpenAI Responses API: vLLM stores a response under its request's ``request_id``
# and serves it again at RESPONSES_PATH/{id} (and /{id}/cancel).
RESPONSES_PATH = "/v1/responses"
PREVIOUS_RESPONSE_ID = "previous_response_id"
MIDDLEWARE = "engine_ext.identity.IdentityMiddleware"
# A body over this is refused (413) rather than passed on unread: the user it names
# could not be overwritten. vLLM's own limit on prompts is far below it.
MAX_BODY_BYTES = 32 * 1024 * 1024
# Paths that answer probes and generate nothing (and /metrics/..., a mounted app).
PROBE_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})
# The probes that say whether the server can serve (/ping is SageMaker's): in api-key
# mode they answer 503 while no API keys are loaded (neither from the control plane nor
# saved), as every request does. /version stays the liveness probe.
READINESS_PATHS = frozenset({"/health", "/ping"})
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
    # api-key mode: SHA-256 (hex) of the operator key, if one is set
    operator_key_sha256: str | None = None
    # header and api-key mode: the server's connection guard (engine_ext/http_server.py)
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    # Where the API server keeps the last keys it applied (engine_ext/saved_state.py).
    state_dir: str | None = None

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


def response_id_prefix(user: str) -> str:
    """How every stored response id of ``user`` begins: the middleware writes the
    ``request_id`` (the stored response's id) of the user's Responses API requests. A
    fixed-length tag, so no user's prefix begins another's."""
    return f"resp_{hashlib.sha256(user.encode('utf-8')).hexdigest()[:24]}_"


def _response_not_found(response_id: str, param: str) -> IdentityRefused:
    # vLLM's own answer for an id it does not store: another user's is no different.
    return IdentityRefused(
        404, f"Response with id '{response_id}' not found.", code="response_not_found", param=param
    )


def check_own_response(user: str, response_id: str, *, param: str) -> None:
    """A 404 for a stored response id that is not ``user``'s."""
    if not response_id.startswith(response_id_prefix(user)):
        raise _response_not_found(response_id, param)


def rewrite_body(body: bytes, user: str, path: str = "") -> bytes | None:
    """``body`` with ``user`` as the request's user, or None when it is no JSON object
    (it then carries no user downstream either, and is passed on as it is). A Responses
    API request at ``path`` RESPONSES_PATH gets a request id of the user's, and one that
    continues a stored response must name one of the user's."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    previous = data.get(PREVIOUS_RESPONSE_ID)
    if isinstance(previous, str):
        check_own_response(user, previous, param=PREVIOUS_RESPONSE_ID)
    if path == RESPONSES_PATH:
        # The caller's own request_id, if any, stays as the tail: unique per user.
        given = data.get("request_id")
        tail = given if isinstance(given, str) and given else uuid.uuid4().hex
        data["request_id"] = response_id_prefix(user) + tail
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


def _bearer(scope: Scope) -> bytes | None:
    """The key of the one ``Authorization: Bearer`` header, or None."""
    values = _header_values(scope, b"authorization")
    if len(values) != 1:
        return None
    scheme, _, key = values[0].partition(b" ")
    key = key.strip()
    return key if scheme.lower() == b"bearer" and key else None


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
        self._tenant_paths = vllm_compat.release().tenant_paths
        self.key_client = key_client
        self._owns_key_client = False
        if self.config.mode == "api-key" and key_client is None:
            self.key_client = self._start_key_client()
            self._owns_key_client = True
        # api-key mode: the requests running with each key (event loop only): key id ->
        # (its user, the app calls), and the calls ended because their key was revoked.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: dict[str, tuple[str, set[asyncio.Future[None]]]] = {}
        self._revoked: set[asyncio.Future[None]] = set()
        if self.key_client is not None:
            self.key_client.on_change = self._keys_changed
        if self.config.mode == "header":
            logger.info(
                "output-rate: identity from the %s header (a request without it: %s)",
                self.config.header,
                self.config.missing,
            )

    def _start_key_client(self) -> KeyClient:
        from engine_ext.key_client import KeyClient
        from engine_ext.saved_state import StateFile, StateWriter

        config = self.config
        assert config.control_plane_endpoints and config.engine_id is not None
        state = (
            None
            if config.state_dir is None
            else StateFile(config.state_dir, config.engine_id, p.API_ROLE)
        )
        client = KeyClient(
            endpoints=config.control_plane_endpoints,
            engine_id=config.engine_id,
            model=config.model,
            server_public_key=config.control_plane_public_key,
            state=None if state is None else StateWriter(state),
        )
        saved = None if state is None else state.load()
        if saved is not None:
            # Until the control plane answers, the keys it last sent keep working (and a
            # key it had revoked stays refused).
            client.install_saved(saved.snapshot)
            logger.info(
                "output-rate: %d API keys of version %d (saved %s in %s) in force until the "
                "control plane answers",
                len(client.table.keys),
                saved.snapshot.version,
                saved.saved_at_text,
                state.path if state is not None else "",
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
        path = _route_path(scope)
        if not is_guarded(scope):
            if self._keys_missing(path):
                await _answer(_keys_not_loaded(), scope, send)
                return
            await self.app(scope, receive, send)
            return
        try:
            if self._is_operator_path(path):
                self._check_operator(scope, path)
                await self.app(self._without_credentials(scope), receive, send)
                return
            user, key_id = self._user_of(scope)
            self._check_user_path(path, user)
        except IdentityRefused as refused:
            await _answer(refused, scope, send)
            return
        scope = self._without_credentials(scope)
        if kind == "websocket":
            await self.app(scope, receive, send)
            return
        await self._rewrite_and_call(scope, receive, send, user, key_id)

    def _lifespan_receive(self, receive: Receive) -> Receive:
        async def lifespan_receive() -> Message:
            message = await receive()
            if message.get("type") == "lifespan.shutdown" and self._owns_key_client:
                assert self.key_client is not None
                # Its id is free at once for the API server that replaces it.
                self.key_client.close(leave=True)
            return message

        return lifespan_receive

    # ---- what a path takes ---------------------------------------------------

    def _is_operator_path(self, path: str) -> bool:
        """api-key mode: a route that is no user's (the release's tenant_paths, the paths
        that cannot carry a user, a stored response) is the operator's."""
        return (
            self.config.mode == "api-key"
            and path not in self._tenant_paths
            and path not in self._no_user_paths
            and not path.startswith(RESPONSES_PATH + "/")
        )

    def _check_operator(self, scope: Scope, path: str) -> None:
        key = _bearer(scope)
        if key is None:
            raise _bad_key("Missing API key: send it as 'Authorization: Bearer <key>'")
        expected = self.config.operator_key_sha256
        # The digests are compared in constant time whatever the key.
        presented = hashlib.sha256(key).hexdigest()
        if expected is None or not hmac.compare_digest(presented, expected):
            raise IdentityRefused(
                403,
                f"{path} is an operator route: it takes the engine's operator key, not a "
                "user's API key",
                code="operator_only",
            )

    def _check_user_path(self, path: str, user: str) -> None:
        if path in self._no_user_paths:
            raise IdentityRefused(
                403,
                f"{path} cannot carry the caller's identity (it has no vllm_xargs) "
                f"and is not served with --output-rate-identity {self.config.mode}",
                code="identity_not_carried",
            )
        if path.startswith(RESPONSES_PATH + "/") and path not in self._tenant_paths:
            # /v1/responses/{id} and /v1/responses/{id}/cancel: the user's own only.
            response_id = path.removeprefix(RESPONSES_PATH + "/").split("/", 1)[0]
            check_own_response(user, response_id, param="response_id")

    # ---- the user, from the headers only ----------------------------------

    def _user_of(self, scope: Scope) -> tuple[str, str | None]:
        """(the user, the id of the key that named it: None in header mode)."""
        if self.config.mode == "api-key":
            return self._user_of_key(scope)
        return self._user_of_header(scope), None

    def _keys_missing(self, path: str) -> bool:
        """api-key mode: a readiness probe answers 503 while no keys are loaded, as every
        request would get."""
        if self.config.mode != "api-key" or path not in READINESS_PATHS:
            return False
        assert self.key_client is not None
        return not self.key_client.has_snapshot

    def _user_of_key(self, scope: Scope) -> tuple[str, str]:
        client = self.key_client
        assert client is not None
        if not client.has_snapshot:
            raise _keys_not_loaded()
        key = _bearer(scope)
        if key is None:
            raise _bad_key("Missing API key: send it as 'Authorization: Bearer <key>'")
        found = client.table.user_of(key.decode("latin-1"))
        if found is None:
            raise _bad_key("Incorrect API key provided")
        key_id, user = found
        client.note_use(key_id)
        return str(user), key_id

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
        if b"," in values[0]:
            # A proxy may fold duplicate headers into one line joined by commas (RFC 9110
            # 5.3): "alice, victim" is two identities, neither of which can be trusted.
            raise IdentityRefused(
                400,
                f"the {name} header holds a comma: duplicate headers folded into one line "
                "(user ids with a comma cannot be named in this header)",
                code="invalid_identity",
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
        self, scope: Scope, receive: Receive, send: Send, user: str, key_id: str | None
    ) -> None:
        path = _route_path(scope)
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
                rewritten = rewrite_body(body, user, path)
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
        if key_id is None:
            await self.app(scope, _replay(body, receive), send)
        else:
            await self._call_while_key_lives(scope, _replay(body, receive), send, key_id, user)

    # ---- a revoked key's running requests -----------------------------------

    async def _call_while_key_lives(
        self, scope: Scope, receive: Receive, send: Send, key_id: str, user: str
    ) -> None:
        """api-key mode: the app's call, cancelled when its key is revoked (or given to
        another user) while it runs. The cancellation reaches vLLM's generator where it
        waits for the engine's next output, and vLLM aborts the request: a stream ends
        within a step of the revocation's arrival, as if its client had gone."""
        self._loop = asyncio.get_running_loop()
        content_type: bytes | None = None

        async def watched_send(message: Message) -> None:
            nonlocal content_type
            if message["type"] == "http.response.start":
                content_type = dict(message.get("headers", ())).get(b"content-type", b"")
            await send(message)

        call = asyncio.ensure_future(self.app(scope, receive, watched_send))
        _, calls = self._running.setdefault(key_id, (user, set()))
        calls.add(call)
        self._end_if_revoked(key_id)  # revoked since the key was checked
        try:
            await call
        except asyncio.CancelledError:
            if call not in self._revoked:
                raise  # this request's own cancellation
            await self._answer_revoked(scope, send, content_type)
        finally:
            calls.discard(call)
            self._revoked.discard(call)
            if not calls:
                self._running.pop(key_id, None)

    def _keys_changed(self) -> None:
        """The key client's IO thread: a snapshot or a key op was applied."""
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._end_revoked)

    def _end_revoked(self) -> None:
        for key_id in list(self._running):
            self._end_if_revoked(key_id)

    def _end_if_revoked(self, key_id: str) -> None:
        assert self.key_client is not None
        user, calls = self._running[key_id]
        record = self.key_client.table.keys.get(key_id)
        if record is not None and record[0] == user:
            return
        for call in calls - self._revoked:
            self._revoked.add(call)
            call.cancel()

    async def _answer_revoked(self, scope: Scope, send: Send, content_type: bytes | None) -> None:
        revoked = IdentityRefused(
            401,
            "The API key was revoked while the request ran",
            code="api_key_revoked",
            headers=((b"www-authenticate", b"Bearer"),),
        )
        if content_type is None:  # nothing sent yet
            await _answer(revoked, scope, send)
            return
        # A stream ends with an error event, as vLLM ends one that fails.
        last = b""
        if content_type.startswith(b"text/event-stream"):
            last = b"data: " + revoked.body() + b"\n\ndata: [DONE]\n\n"
        await send({"type": "http.response.body", "body": last, "more_body": False})


def _keys_not_loaded() -> IdentityRefused:
    return IdentityRefused(
        503,
        "API keys are not loaded yet (no answer from the control plane); retry shortly",
        code="keys_not_loaded",
        type_="server_error",
        headers=((b"retry-after", b"1"),),
    )


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
