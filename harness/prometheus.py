"""A real Prometheus (Debian's package) as a plain process: temp config and storage, random port."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from harness.servers import Process, free_port, wait_healthy

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


class Prometheus(Process):
    """Scrapes ``targets`` (job -> scrape config fields) every ``interval``."""

    def __init__(self, tmp: Path, jobs: list[dict[str, Any]], interval: str = "1s") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": jobs,
        }
        config_path = tmp / "prometheus.yml"
        config_path.write_text(json.dumps(config))  # JSON is YAML
        super().__init__(
            [
                PROMETHEUS,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            tmp / "prometheus.log",
        )

    def wait_ready(self) -> None:
        wait_healthy(f"{self.url}/-/ready", self.popen, self.log_path, timeout_s=60)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; fails the test if Prometheus does not answer with success."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def values(self, expr: str, label: str) -> dict[str, float]:
        """label value -> sample value of an instant vector."""
        return {r["metric"].get(label, ""): float(r["value"][1]) for r in self.query(expr)}

    def scalar(self, expr: str) -> float | None:
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, check: Callable[[], bool], timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError("Prometheus did not see the expected data in time")
            time.sleep(0.5)

    def targets_up(self) -> bool:
        targets = httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()["data"]
        active = targets["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)
