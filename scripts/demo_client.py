"""The demo's live view: a tenant with many streams beside a normal user.

Phases (each ``--phase-seconds`` long):

1. ``tenant`` (no limit) holds 3x the engine's resident slots of concurrent
   streams; ``normal`` sends one short request after another. The normal
   user's time to first token and tokens/s collapse: every slot is taken.
2. The operator gives ``tenant`` a limit over REST (``PUT /limits/tenant`` on
   the control plane); the engine applies it at its next step, the normal
   user recovers at once, the tenant goes on at its limit.
3. With ``--forever``: a light load keeps running (the tenant at its limit,
   the normal user pausing between requests) so the admin UI's live view has
   something to show, until Ctrl-C.

On a terminal the view redraws in place; otherwise one line per refresh.
Each user's speed is shown twice: as the engine granted it (the control
plane's ``GET /usage``, ``output_tokens_per_second_1s``) and as this client
read it (tokens counted from the usage block of every chunk, since byte-level
text pieces merge). The client figure lags and bunches when one process reads
49 streams on a busy machine; the engine figure is what the limit applies to.
Example:

    python scripts/demo_client.py --url http://127.0.0.1:8000 \
        --control-plane http://127.0.0.1:8700 --token demo-admin-token
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import httpx

SPARK = " ▁▂▃▄▅▆▇█"
WINDOW_S = 2.0  # tokens/s is measured over this trailing window
HISTORY = 60  # refreshes kept for the sparkline
USAGE_POLL_S = 0.5  # how often the engine's per-user rates are read (GET /usage)
RETRY_PAUSE_S = 0.2  # before a stream cut by a connection error is reopened


@dataclass
class UserView:
    name: str
    num_streams: int = 0
    limit: str = "unlimited"
    token_times: deque[float] = field(default_factory=deque)
    ttft_ms: deque[float] = field(default_factory=lambda: deque(maxlen=20))
    num_done: int = 0
    # Streams cut by a transport error (a reset connection under load); retried.
    num_failed: int = 0
    # When the request now in flight was sent, until its first token.
    pending_since: float | None = None
    # Tokens/s of the last finished request, first token to last.
    last_stream_rate: float | None = None
    # Tokens/s the engine granted the user over its last 1 s (GET /usage); None
    # until read, or while the control plane cannot be reached.
    engine_rate: float | None = None
    history: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))

    def rate(self, now: float) -> float:
        while self.token_times and self.token_times[0] < now - WINDOW_S:
            self.token_times.popleft()
        return len(self.token_times) / WINDOW_S


async def stream_once(
    client: httpx.AsyncClient, url: str, model: str, view: UserView, max_tokens: int
) -> None:
    body = {
        "model": model,
        "prompt": "Tell me a story about rate limits.",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "vllm_xargs": {"output_rate_user": view.name},
    }
    sent = view.pending_since = time.monotonic()
    first = last = sent
    seen = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            usage = json.loads(line[6:]).get("usage") or {}
            num_tokens = usage.get("completion_tokens", seen)
            if num_tokens > seen:
                now = time.monotonic()
                if seen == 0:
                    view.ttft_ms.append((now - sent) * 1000)
                    view.pending_since = None
                    first = now
                last = now
                view.token_times.extend([now] * (num_tokens - seen))
                seen = num_tokens
    view.num_done += 1
    if seen > 1 and last > first:
        view.last_stream_rate = (seen - 1) / (last - first)


async def keep_streaming(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    view: UserView,
    max_tokens: int,
    pause_s: float | list[float],
) -> None:
    """One stream, reopened as it ends (after ``pause_s[0]`` if given as a list).

    A connection error ends the stream, not the demo: counted, and reopened.
    """
    while True:
        try:
            await stream_once(client, url, model, view, max_tokens)
        except httpx.TransportError:
            view.num_failed += 1
            view.pending_since = None
            await asyncio.sleep(RETRY_PAUSE_S)
            continue
        pause = pause_s[0] if isinstance(pause_s, list) else pause_s
        await asyncio.sleep(pause)


async def poll_engine_rates(
    client: httpx.AsyncClient, control_plane: str, auth: dict[str, str], views: list[UserView]
) -> None:
    """Keep each view's ``engine_rate`` current from the control plane's ``GET /usage``.

    A user missing from the answer had no tokens granted in the usage window: 0.
    """
    while True:
        try:
            response = await client.get(f"{control_plane}/usage", headers=auth)
        except httpx.TransportError:
            for view in views:
                view.engine_rate = None
        else:
            response.raise_for_status()
            # user id -> tokens/s granted over the engines' last 1 s
            rates = {
                item["user"]: item["output_tokens_per_second_1s"]
                for item in response.json()["items"]
            }
            for view in views:
                view.engine_rate = rates.get(view.name, 0.0)
        await asyncio.sleep(USAGE_POLL_S)


def spark_cell(rate: float, peak: float) -> str:
    # Any tokens at all show as the lowest bar: a limited tenant beside a peak of
    # hundreds of tok/s would otherwise look idle.
    level = round(8 * rate / peak)
    return SPARK[min(8, max(level, 1 if rate > 0 else 0))]


def fmt_rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1f}"


class Screen:
    def __init__(self, views: list[UserView], header: str) -> None:
        self.views = views
        self.header = header
        self.phase = ""
        self.events: deque[str] = deque(maxlen=4)
        self.is_tty = sys.stdout.isatty()

    def draw(self) -> None:
        now = time.monotonic()
        rates = {v.name: v.rate(now) for v in self.views}
        for v in self.views:
            v.history.append(v.engine_rate or 0.0)
        if not self.is_tty:
            cells = "  ".join(
                f"{v.name}: engine {fmt_rate(v.engine_rate):>6} tok/s (1 s) "
                f"client {rates[v.name]:6.1f} tok/s ttft {self._ttft(v)}"
                + (f" ({v.num_failed} cut)" if v.num_failed else "")
                for v in self.views
            )
            print(f"[{self.phase}] {cells}", flush=True)
            return
        lines = [self.header, "", f"\033[1m{self.phase}\033[0m", ""]
        lines.append(
            f"{'user':8} {'streams':>7} {'engine tok/s (1 s)':>18} {'client tok/s':>12} "
            f"{'limit':>10} {'1 stream':>9} {'TTFT last':>10} {'TTFT p50':>9} {'done':>6}  "
            f"engine tok/s, last {HISTORY} refreshes"
        )
        peak = max([max(v.history) for v in self.views] + [1.0])
        for v in self.views:
            spark = "".join(spark_cell(x, peak) for x in v.history)
            p50 = f"{statistics.median(v.ttft_ms):.0f} ms" if v.ttft_ms else "-"
            stream = f"{v.last_stream_rate:.0f}" if v.last_stream_rate is not None else "-"
            failed = f" ({v.num_failed} cut)" if v.num_failed else ""
            lines.append(
                f"{v.name:8} {v.num_streams:>7} {fmt_rate(v.engine_rate):>18} "
                f"{rates[v.name]:>12.1f} {v.limit:>10} {stream:>9} {self._ttft(v):>10} "
                f"{p50:>9} {v.num_done:>6}  {spark}{failed}"
            )
        lines += [
            "",
            "engine tok/s (1 s): tokens the engine granted the user in its last 1 s "
            "(control plane, GET /usage), what the limit applies to",
            f"client tok/s: tokens this client read over the last {WINDOW_S:.0f} s, all streams "
            "(one process reading every stream: late and bunched on a busy machine)",
            "1 stream: client-side speed of the user's last finished request",
            "",
            *self.events,
        ]
        sys.stdout.write("\033[H\033[J" + "\n".join(lines) + "\n")
        sys.stdout.flush()

    @staticmethod
    def _ttft(view: UserView) -> str:
        # A request still waiting for its first token longer than the last
        # TTFT says more than the last TTFT does.
        waited_ms = 0.0
        if view.num_streams == 1 and view.pending_since is not None:
            waited_ms = (time.monotonic() - view.pending_since) * 1000
        last_ms = view.ttft_ms[-1] if view.ttft_ms else 0.0
        if waited_ms > max(last_ms, 500):
            return f">{waited_ms / 1000:.1f} s"
        return f"{last_ms:.0f} ms" if view.ttft_ms else "-"


async def run(args: argparse.Namespace) -> None:
    tenant = UserView("tenant", num_streams=args.tenant_streams)
    normal = UserView("normal", num_streams=1)
    screen = Screen(
        [tenant, normal],
        f"vllm-output-rate demo: engine {args.url}, control plane {args.control_plane} "
        f"(UI {args.control_plane}/ui/)",
    )
    auth = {"Authorization": f"Bearer {args.token}"}
    # Idle connections are dropped before the server's keep-alive (uvicorn: 5 s)
    # can close them under a request that reuses one.
    limits = httpx.Limits(max_connections=args.tenant_streams + 8, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        model = (await client.get(f"{args.url}/v1/models")).json()["data"][0]["id"]
        normal_pause = [0.2]
        tasks = [
            asyncio.create_task(keep_streaming(client, args.url, model, tenant, 400, 0.0))
            for _ in range(args.tenant_streams)
        ]
        tasks.append(
            asyncio.create_task(keep_streaming(client, args.url, model, normal, 40, normal_pause))
        )
        tasks.append(
            asyncio.create_task(
                poll_engine_rates(client, args.control_plane, auth, [tenant, normal])
            )
        )

        async def show(phase: str, seconds: float) -> None:
            screen.phase = phase
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                for task in tasks:
                    if task.done() and task.exception():
                        raise task.exception()  # type: ignore[misc]
                screen.draw()
                await asyncio.sleep(args.refresh)

        await show(
            f"1/3  tenant has no limit and {args.tenant_streams} streams "
            f"(more than the engine's {args.tenant_streams // 3} resident slots)",
            args.phase_seconds,
        )
        body = {"tier": args.tier, "output_tokens_per_second": None}
        sent = time.monotonic()
        response = await client.put(f"{args.control_plane}/limits/tenant", json=body, headers=auth)
        response.raise_for_status()
        version = response.json()["version"]
        limit = response.json()["effective_output_tokens_per_second"]
        screen.events.append(
            f"operator: PUT /limits/tenant {json.dumps(body)} -> version {version}"
        )
        applied = await wait_applied(client, args.control_plane, auth, version)
        screen.events.append(
            f"every engine applied version {version} {1000 * (applied - sent):.0f} ms "
            "after the PUT (no restart)"
        )
        tenant.limit = str(limit)
        await show(
            f"2/3  tenant in tier {args.tier!r} ({limit} tok/s): the normal user is served at once",
            args.phase_seconds,
        )
        if args.forever:
            normal_pause[0] = 1.0
            screen.events.append("light load until Ctrl-C: watch it in the admin UI")
            await show("3/3  light load (Ctrl-C stops)", float("inf"))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    print(
        f"normal user: TTFT p50 {summary(normal)}; tenant: {tenant.num_done} streams done",
        flush=True,
    )


async def wait_applied(
    client: httpx.AsyncClient, control_plane: str, auth: dict[str, str], version: int
) -> float:
    """When every connected engine reports ``version`` applied (GET /engines)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        engines = (await client.get(f"{control_plane}/engines", headers=auth)).json()["items"]
        live = [e for e in engines if e["connected"]]
        if live and all(e["applied_version"] >= version for e in live):
            return time.monotonic()
        await asyncio.sleep(0.005)
    raise RuntimeError(f"version {version} not applied by every engine within 30 s")


def summary(view: UserView) -> str:
    return f"{statistics.median(view.ttft_ms):.0f} ms" if view.ttft_ms else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--control-plane", default="http://127.0.0.1:8700")
    parser.add_argument("--token", default="demo-admin-token")
    parser.add_argument("--tenant-streams", type=int, default=48)
    parser.add_argument("--tier", default="free", help="the tier the operator moves tenant to")
    parser.add_argument("--phase-seconds", type=float, default=15.0)
    parser.add_argument("--refresh", type=float, default=0.5)
    parser.add_argument("--forever", action="store_true", help="keep a light load until Ctrl-C")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
