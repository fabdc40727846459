"""An OpenAI-API client that measures per-token arrival, as a user would.

Tokens are counted from the usage block of every chunk
(``continuous_usage_stats``), never from text, which byte-level pieces merge.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class StreamResult:
    user: str | None
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # Client clock: request sent, response fully read.
    started: float = 0.0
    finished: float = 0.0
    completion_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """Lines of an SSE body, split on "\n" only.

    httpx's ``aiter_lines`` also splits on U+2028, U+0085 and similar, which
    JSON leaves unescaped and a random-weight model happily generates.
    """
    pending = ""
    async for text in response.aiter_text():
        pending += text
        *lines, pending = pending.split("\n")
        for line in lines:
            yield line.rstrip("\r")
    if pending:
        yield pending


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    *,
    user: str | None,
    max_tokens: int,
    prompt: str = "Once upon a time",
    stop_after_tokens: int | None = None,
    cancel: asyncio.Event | threading.Event | None = None,
    result: StreamResult | None = None,
    **extra: Any,
) -> StreamResult:
    """``result``: filled in place, so what arrived before the stream broke (an engine
    stopped under it) is still the caller's when this raises."""
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **extra,
    }
    body.setdefault("ignore_eos", True)
    if user is not None:
        body["vllm_xargs"] = {"output_rate_user": user}
    if result is None:
        result = StreamResult(user=user)
    result.started = time.monotonic()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in sse_lines(response):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.monotonic()
            for choice in chunk.get("choices") or ():
                result.text += choice.get("text") or ""
                result.token_ids.extend(choice.get("token_ids") or ())
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
            usage = chunk.get("usage") or {}
            num_tokens = usage.get("completion_tokens", result.completion_tokens)
            result.token_times.extend([now] * (num_tokens - result.completion_tokens))
            result.completion_tokens = num_tokens
            if stop_after_tokens is not None and num_tokens >= stop_after_tokens:
                break  # client cancels mid-stream: closing the response aborts it
            if cancel is not None and cancel.is_set():
                break  # likewise, once the caller has seen enough (checked per chunk)
    result.finished = time.monotonic()
    return result


def wall_rate(result: StreamResult) -> float:
    """Tokens per second of wall time, request sent to last byte read.

    Unlike first-to-last token spans, this cannot be inflated by chunks that
    a stalled process delivers all at once.
    """
    return result.completion_tokens / (result.finished - result.started)


def user_rate(results: list[StreamResult], *, skip: int = 0) -> tuple[int, float]:
    """(tokens, first-to-last token span in s) over all of a user's streams.

    ``skip`` leaves out the user's first tokens: they arrive together with the
    start-up work of every stream begun at the same time, and their delivery
    delay would shorten the measured span.
    """
    times = sorted(t for r in results for t in r.token_times)[skip:]
    return len(times), times[-1] - times[0]


def run(coro: Any) -> Any:
    return asyncio.run(coro)
