"""A real push client driven as an engine core drives it, for tests and benchmarks that
need engines without vLLM."""

from __future__ import annotations

import threading
import time
from typing import Self

from engine_ext.limiter import OutputRateLimiter
from engine_ext.push_client import PushClient


class ApplyingEngine:
    """A real push client whose engine side runs on a thread of its own, as in an engine
    core: woken by the client, it applies what arrived and notes when each version was
    applied. A subclass adds the rest of its step in `after_apply`."""

    def __init__(
        self,
        name: str,
        endpoints: list[str],
        *,
        model: str = "tiny",
        server_public_key: str | None = None,
        client_secret_key: str | None = None,
        vllm_version: str | None = None,
    ) -> None:
        """``vllm_version``: what its HELLO says it runs (None: the vLLM installed here)."""
        self.name = name
        self.limiter = OutputRateLimiter(None)
        self._woken = threading.Event()
        self.client = PushClient(
            endpoints=endpoints,
            engine_id=name,
            model=model,
            server_public_key=server_public_key,
            client_secret_key=client_secret_key,
            wake=self._woken.set,
            vllm_version=vllm_version,
        )
        # version -> when it was applied (time.monotonic)
        self.applied_at: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.client.start()
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.client.close()

    def __enter__(self) -> Self:
        self.start()
        assert self.client.wait_for_snapshot(60), f"{self.name}: no snapshot"
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def wait_applied(self, version: int, timeout_s: float = 60.0) -> float:
        """When (time.monotonic) `version` was applied, waiting for it at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (at := self.applied_at.get(version)) is None:
            assert time.monotonic() < deadline, (
                f"{self.name} stuck at version {self.client.applied_version}, not {version}"
            )
            time.sleep(0.0005)
        return at

    def after_apply(self, now: float) -> None:
        """The rest of the engine thread's step (`now`: time.monotonic)."""

    def _run(self) -> None:
        while not self._stop.is_set():
            self._woken.wait(0.02)
            self._woken.clear()
            before = self.client.applied_version
            self.client.apply_pending(self.limiter)
            now = time.monotonic()
            for version in range(before + 1, self.client.applied_version + 1):
                self.applied_at.setdefault(version, now)
            self.after_apply(now)
