"""Added latency of the identity check on the API server (docs/identity.md).

Two measurements, each side by side with no middleware in the same run:

1. In process: the ASGI call of a trivial app (reads the body, answers 200) with and
   without ``IdentityMiddleware`` in front, in api-key mode (10,000 keys loaded into a
   real KeyClient by a scripted push server) and header mode; interleaved call by call.
2. Over HTTP: three real uvicorn servers on 127.0.0.1 (bare app, api-key, header), one
   keep-alive client, requests interleaved round-robin across the three.

Bodies: a typical completion request (~0.3 KB) and one with a 100 KB prompt.

Run: .venv/bin/python -m bench.identity_bench   (writes bench/results/identity.md)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from engine_ext.identity import IdentityConfig, IdentityMiddleware
from engine_ext.key_client import KeyClient
from harness.scripted_server import ScriptedServer
from harness.servers import free_port
from output_rate_core import keys
from output_rate_core import protocol as p

NUM_KEYS = 10_000
HEADER = "X-Gateway-User"
RESULTS = Path(__file__).parent / "results" / "identity.md"


async def trivial_app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            kind = (await receive())["type"]
            await send({"type": kind + ".complete"})
            if kind == "lifespan.shutdown":
                return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def loaded_key_client() -> tuple[ScriptedServer, KeyClient, str]:
    """A KeyClient holding NUM_KEYS keys from a snapshot; returns one of them."""
    server = ScriptedServer()
    client = KeyClient(
        endpoints=[server.endpoint], engine_id="bench", model="", server_public_key=None
    )
    client.start()
    made = [keys.new_key() for _ in range(NUM_KEYS)]
    table = {kid: (f"user-{i % 1000}", keys.hash_key(key)) for i, (kid, key) in enumerate(made)}
    identity, _ = server.recv(p.Hello)
    server.send(identity, p.Snapshot(1, None, {}, {}, keys=table))
    deadline = time.monotonic() + 30
    while not client.has_snapshot:
        if time.monotonic() > deadline:
            raise RuntimeError("no snapshot")
        time.sleep(0.01)
    return server, client, made[NUM_KEYS // 2][1]


def body_of(prompt_bytes: int) -> bytes:
    body = {
        "model": "tiny",
        "prompt": "x" * prompt_bytes,
        "max_tokens": 200,
        "stream": True,
        "vllm_xargs": {"output_rate_user": "someone-else"},
    }
    return json.dumps(body).encode()


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[int(0.99 * (len(ordered) - 1))]


# ---- 1. in process ------------------------------------------------------------------


async def asgi_call(app: Any, headers: list[tuple[bytes, bytes]], body: bytes) -> float:
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Any) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200, message

    start = time.perf_counter_ns()
    await app(scope, receive, send)
    return (time.perf_counter_ns() - start) / 1000


async def in_process(
    apps: dict[str, tuple[Any, list[tuple[bytes, bytes]]]], body: bytes, num: int
) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in apps}
    for i in range(num + num // 10):
        for name, (app, headers) in apps.items():
            micros = await asgi_call(app, headers, body)
            if i >= num // 10:  # warm-up left out
                samples[name].append(micros)
    return samples


# ---- 2. over HTTP -------------------------------------------------------------------


def serve(app: Any) -> tuple[uvicorn.Server, threading.Thread, str]:
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{port}"


def over_http(
    urls: dict[str, tuple[str, dict[str, str]]], body: bytes, num: int
) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in urls}
    clients = {name: httpx.Client(base_url=url, headers=h) for name, (url, h) in urls.items()}
    headers = {"content-type": "application/json"}
    try:
        for i in range(num + num // 10):
            for name, client in clients.items():
                start = time.perf_counter_ns()
                response = client.post("/v1/completions", content=body, headers=headers)
                micros = (time.perf_counter_ns() - start) / 1000
                assert response.status_code == 200, response.text
                if i >= num // 10:
                    samples[name].append(micros)
    finally:
        for client in clients.values():
            client.close()
    return samples


def rows_of(samples: dict[str, list[float]], label: str) -> list[str]:
    base_p50, base_p99 = percentiles(samples["none"])
    rows = []
    for name, values in samples.items():
        p50, p99 = percentiles(values)
        added = "" if name == "none" else f"{p50 - base_p50:+.1f} / {p99 - base_p99:+.1f}"
        rows.append(f"| {label} | {name} | {p50:.1f} | {p99:.1f} | {added} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--http-requests", type=int, default=1500)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    push, key_client, key = loaded_key_client()
    header_config = IdentityConfig(mode="header", header=HEADER)
    api = IdentityMiddleware(trivial_app, IdentityConfig(mode="api-key"), key_client=key_client)
    header = IdentityMiddleware(trivial_app, header_config)
    auth = [(b"authorization", f"Bearer {key}".encode())]
    common = [(b"content-type", b"application/json")]
    apps: dict[str, tuple[Any, list[tuple[bytes, bytes]]]] = {
        "none": (trivial_app, [*common, *auth]),
        "api-key": (api, [*common, *auth]),
        "header": (header, [*common, (HEADER.lower().encode(), b"user-7")]),
    }
    bodies = {"0.3 KB body": body_of(100), "100 KB body": body_of(100_000)}
    asgi_rows: list[str] = []
    for label, body in bodies.items():
        asgi_rows += rows_of(asyncio.run(in_process(apps, body, args.requests)), label)

    servers = [serve(app) for app, _ in apps.values()]
    urls: dict[str, tuple[str, dict[str, str]]] = {
        "none": (servers[0][2], {"authorization": f"Bearer {key}"}),
        "api-key": (servers[1][2], {"authorization": f"Bearer {key}"}),
        "header": (servers[2][2], {HEADER: "user-7"}),
    }
    http_rows: list[str] = []
    for label, body in bodies.items():
        http_rows += rows_of(over_http(urls, body, args.http_requests), label)
    for server, thread, _ in servers:
        server.should_exit = True
        thread.join(timeout=10)
    key_client.close()
    push.close()

    head = "| body | middleware | p50 µs | p99 µs | added p50 / p99 µs |\n|---|---|---|---|---|"
    report = f"""# Identity check: added latency per request on the API server

Reproduce: `.venv/bin/python -m bench.identity_bench` ({args.requests} in-process calls
and {args.http_requests} HTTP requests per cell after a 10 % warm-up, the three
variants interleaved request by request in one run). Machine: {platform.machine()},
{platform.python_implementation()} {platform.python_version()}, 2 shared cores;
{time.strftime("%Y-%m-%d", time.gmtime())}.

api-key: {NUM_KEYS:,} keys loaded (a real KeyClient fed by a scripted push server), a
valid key in `Authorization: Bearer`; header: `{HEADER}`. Both rewrite the JSON body
(its `vllm_xargs` claims another user). "none" is the same trivial ASGI app with no
middleware. The body is what a completion request carries: `prompt` of 100 bytes or
100 KB.

## In process (the middleware's own cost)

The ASGI call of the app, timed around `await app(scope, receive, send)`.

{head}
{chr(10).join(asgi_rows)}

## Over HTTP (uvicorn on 127.0.0.1, one keep-alive client)

Client-side request latency, a trivial app behind each server.

{head}
{chr(10).join(http_rows)}
"""
    print(report)
    if not args.no_write:
        RESULTS.write_text(report)


if __name__ == "__main__":
    main()
