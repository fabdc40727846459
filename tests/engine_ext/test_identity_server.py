"""The identity middleware in the installed vLLM's own OpenAI server app (no engine, no model).

The app is vLLM's ``build_app`` for the arguments vLLM's own parser and the plugin's
``from_cli_args`` produce (which add the middleware); requests go through a real HTTP
client (httpx's ASGI transport). Without an engine, a request whose body vLLM accepted
reaches its handler and fails there (500); a body vLLM's request model refused would be
a 400 or 422. Run on every supported release (scripts/test.sh).
"""

from __future__ import annotations

import importlib.util
import json
import typing
from typing import Any

import httpx
import pydantic
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.app import build_app
from vllm.utils.argparse_utils import FlexibleArgumentParser

from engine_ext import vllm_compat
from engine_ext.identity import IDENTITY_ENV, OPERATOR_KEY_ENV, PROBE_PATHS, RESPONSES_PATH
from engine_ext.plugin import LIMITING_ENV, register
from harness.scheduler import TINY_MODEL

pytestmark = pytest.mark.anyio

HEADER = "X-Gateway-User"
USER_BODIES = {
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 3},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages": {
        "model": "tiny",
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "hi"}],
    },
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def build(*flags: str, env: dict[str, str] | None = None) -> FastAPI:
    """vLLM's app for these flags, its middleware built under ``env`` and the settings
    the plugin put in the environment (the middleware reads them when it is built)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(LIMITING_ENV, "0")
        monkeypatch.delenv(IDENTITY_ENV, raising=False)
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        register()
        parser = vllm_compat.make_arg_parser(FlexibleArgumentParser())
        args = parser.parse_args(["--model", str(TINY_MODEL), *flags])
        AsyncEngineArgs.from_cli_args(args)  # adds the middleware, sets IDENTITY_ENV
        assert args.middleware == ["engine_ext.identity.IdentityMiddleware"]
        built = build_app(args, ("generate",), None)
        built.middleware_stack = built.build_middleware_stack()
        return built


# Every route of the server no user's key opens in api-key mode, with the development
# routes (VLLM_SERVER_DEV_MODE) and runtime LoRA loading on: the same on every release.
@pytest.fixture(scope="module")
def app() -> FastAPI:
    return build(
        "--default-user-output-tokens-per-second",
        "5",
        "--output-rate-identity",
        "header",
        "--output-rate-identity-header",
        HEADER,
    )


OPERATOR_ROUTES = {
    "/abort_requests",
    "/adapters",
    "/adapters/{adapter_name}",
    "/collective_rpc",
    "/finish_weight_update",
    "/get_world_size",
    "/inference/v1/abort_requests",
    "/init_weight_transfer_engine",
    "/is_paused",
    "/is_scaling_elastic_ep",
    "/is_sleeping",
    "/kv_event_sources",
    "/load",
    "/pause",
    "/release_kv_cache_memory",
    "/reset_encoder_cache",
    "/reset_mm_cache",
    "/reset_prefix_cache",
    "/resume",
    "/scale_elastic_ep",
    "/server_info",
    "/shutdown_weight_transfer_engine",
    "/sleep",
    "/start_draft_weight_update",
    "/start_weight_update",
    "/update_weight_version",
    "/update_weights",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/wake_up",
    "/weight_checker",
    "/weight_info",
}
OPERATOR_KEY = "o" * 40


@pytest.fixture(scope="module")
def operator_app() -> FastAPI:
    env = {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        OPERATOR_KEY_ENV: OPERATOR_KEY,
    }
    # The key client never reaches a control plane: operator routes need no user keys.
    return build(
        "--control-plane-endpoint",
        "tcp://127.0.0.1:1",
        "--output-rate-identity",
        "api-key",
        "--enable-scale-out",
        env=env,
    )


def _routes(app: FastAPI) -> dict[str, set[str]]:
    """path -> methods of every route of the app (a mounted app: no methods)."""
    return {r.path: set(getattr(r, "methods", None) or ()) for r in app.routes}


def test_every_route_is_a_users_a_probe_or_the_operators(operator_app: FastAPI) -> None:
    """A route a new release adds fails here until it is classified; unclassified, it
    would be the operator's (refused to every user's key)."""
    release = vllm_compat.release()
    others = {
        path
        for path in _routes(operator_app)
        if path not in release.tenant_paths | release.no_user_paths | PROBE_PATHS
        and not path.startswith(RESPONSES_PATH + "/")
    }
    assert others == OPERATOR_ROUTES


async def test_operator_routes_refuse_a_users_key_and_serve_the_operators(
    operator_app: FastAPI,
) -> None:
    routes = _routes(operator_app)
    async with client_of(operator_app) as http:
        for path in sorted(OPERATOR_ROUTES):
            url = path.replace("{adapter_name}", "some-adapter")
            for method in sorted(routes[path] - {"HEAD"}):
                refused = await http.request(method, url, headers={"Authorization": "Bearer x"})
                assert refused.status_code == 403, (method, path, refused.text)
                assert refused.json()["error"]["code"] == "operator_only"
                auth = {"Authorization": f"Bearer {OPERATOR_KEY}"}
                served = await http.request(method, url, headers=auth)
                # Past the middleware: vLLM answers (without an engine, mostly a 500).
                assert served.status_code not in (401, 403), (method, path, served.text)


def client_of(app: FastAPI) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://engine")


def body_models(route: APIRoute) -> list[type[pydantic.BaseModel]]:
    if route.body_field is None:
        return []
    annotation = route.body_field.field_info.annotation
    candidates = typing.get_args(annotation) or (annotation,)
    return [m for m in candidates if isinstance(m, type) and issubclass(m, pydantic.BaseModel)]


def post_routes(app: FastAPI) -> dict[str, APIRoute]:
    return {r.path: r for r in app.routes if isinstance(r, APIRoute) and "POST" in r.methods}


def test_the_release_row_names_routes_the_server_has(app: FastAPI) -> None:
    expected = set(vllm_compat.release().no_user_paths)
    if importlib.util.find_spec("cohere") is None:
        expected.discard("/cohere/v2/chat")  # mounted only with Cohere's SDK installed
    assert expected <= post_routes(app).keys()


def test_every_body_model_takes_the_rewritten_user_or_its_route_is_refused(
    app: FastAPI,
) -> None:
    """The middleware writes ``vllm_xargs`` into every guarded body. A request model that
    forbids unknown fields would answer that with a 400 (vLLM 0.33's /v1/decisions), so
    such a route must be one the middleware refuses before the body is read."""
    no_user_paths = vllm_compat.release().no_user_paths
    for path, route in post_routes(app).items():
        if path in no_user_paths:
            continue
        for model in body_models(route):
            takes_it = "vllm_xargs" in model.model_fields
            assert takes_it or model.model_config.get("extra") != "forbid", (path, model)


async def test_a_route_without_a_user_is_refused_before_vllm_reads_it(app: FastAPI) -> None:
    async with client_of(app) as http:
        for path in sorted(vllm_compat.release().no_user_paths):
            response = await http.post(path, json={"model": "tiny"}, headers={HEADER: "alice"})
            assert response.status_code == 403, (path, response.text)
            assert response.json()["error"]["code"] == "identity_not_carried"


@pytest.mark.parametrize("path", list(USER_BODIES))
async def test_the_rewritten_body_is_accepted_by_vllm_and_names_the_header_user(
    app: FastAPI, path: str
) -> None:
    body = USER_BODIES[path] | {"vllm_xargs": {"output_rate_user": "mallory", "x": 1}}
    async with client_of(app) as http:
        refused = await http.post(path, json=body)
        served = await http.post(path, json=body, headers={HEADER: "alice"})
    assert refused.status_code == 401
    # Past the middleware and vLLM's own validation: the missing engine fails the handler.
    assert served.status_code == 500, served.text
    (model,) = body_models(post_routes(app)[path])
    rewritten = _rewritten(body, "alice")
    assert model.model_validate(rewritten).vllm_xargs == {"output_rate_user": "alice", "x": 1}


def _rewritten(body: dict[str, Any], user: str) -> dict[str, Any]:
    from engine_ext.identity import rewrite_body

    out = rewrite_body(json.dumps(body).encode(), user)
    assert out is not None
    return dict(json.loads(out))
