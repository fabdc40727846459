"""Stream from a vLLM server as several users at once and print live tokens/s.

Tokens are counted from the usage block of every chunk
(``continuous_usage_stats``), not from text deltas, which byte-level pieces
merge. Example:

    python scripts/demo_client.py --url http://127.0.0.1:8000 \
        --user user-a:4 --user user-b:1 --max-tokens 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class UserStats:
    num_streams: int
    # (monotonic time, tokens so far in that stream's usage) per chunk.
    token_times: list[float] = field(default_factory=list)
    num_completed: int = 0

    def rate_since(self, since: float) -> float:
        recent = [t for t in self.token_times if t >= since]
        return len(recent) / max(1e-9, time.monotonic() - since)

    def overall_rate(self) -> float:
        if len(self.token_times) < 2:
            return 0.0
        return (len(self.token_times) - 1) / (self.token_times[-1] - self.token_times[0])


async def stream_once(
    client: httpx.AsyncClient, url: str, model: str, user: str, stats: UserStats, max_tokens: int
) -> None:
    body = {
        "model": model,
        "prompt": "Tell me a story about rate limits.",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "vllm_xargs": {"output_rate_user": user},
    }
    seen = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            usage = json.loads(line[6:]).get("usage") or {}
            now = time.monotonic()
            num_tokens = usage.get("completion_tokens", seen)
            stats.token_times.extend([now] * (num_tokens - seen))
            seen = num_tokens
    stats.num_completed += 1


async def run(url: str, users: dict[str, int], max_tokens: int, interval_s: float) -> None:
    async with httpx.AsyncClient(timeout=None) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        stats = {user: UserStats(n) for user, n in users.items()}
        tasks = [
            asyncio.create_task(stream_once(client, url, model, user, stats[user], max_tokens))
            for user, n in users.items()
            for _ in range(n)
        ]
        while not all(t.done() for t in tasks):
            since = time.monotonic()
            await asyncio.sleep(interval_s)
            line = "  ".join(
                f"{user} ({s.num_streams} streams): {s.rate_since(since):6.1f} tok/s"
                for user, s in stats.items()
            )
            print(line, flush=True)
        await asyncio.gather(*tasks)
        for user, s in stats.items():
            print(
                f"{user}: {len(s.token_times)} tokens in {s.num_completed} streams, "
                f"{s.overall_rate():.1f} tok/s first-to-last token"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--user", action="append", default=[], help="NAME:STREAMS")
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args()
    users = {}
    for spec in args.user or ["user-a:1"]:
        name, _, count = spec.partition(":")
        users[name] = int(count or 1)
    asyncio.run(run(args.url, users, args.max_tokens, args.interval))


if __name__ == "__main__":
    main()
