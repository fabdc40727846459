"""CPU used by an engine whose every request is throttled: patched vs upstream spin.

Both servers run the plugin with a default limit of 1 tok/s; 8 users stream
at once, so after their first token every request is throttled. CPU time of
the engine-core process (and of its CPU worker) is read with psutil over the
same window, for the patched idle wait and for upstream's 1 ms spin, one
after the other in one run.

Run: .venv/bin/python -m bench.idle_cpu_bench
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from tests.e2e.servers import Process, free_port, vllm_command, vllm_env

WINDOW_S = 10.0
FLAGS = ("--default-user-output-tokens-per-second", "1", "--max-num-seqs", "16")


def start(spin: bool, log: Path) -> tuple[Process, str]:
    port = free_port()
    command = vllm_command(port, *FLAGS)
    if spin:
        command[1:3] = ["-m", "bench.spin_server"]
    process = Process(command, log, env=vllm_env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(1)
    raise RuntimeError(process.log()[-3000:])


def cpu_by_role(root_pid: int) -> dict[str, float]:
    totals: dict[str, float] = {}
    for child in psutil.Process(root_pid).children(recursive=True):
        try:
            name = child.name()
            times = child.cpu_times()
        except psutil.Error:
            continue
        role = "engine_core" if "EngineCor" in name else ("worker" if "Wor" in name else "other")
        totals[role] = totals.get(role, 0.0) + times.user + times.system
    return totals


def measure(spin: bool) -> dict[str, float]:
    process, url = start(spin, Path(f"/tmp/idle-{'spin' if spin else 'wait'}.log"))
    try:

        def stream(user: str) -> None:
            body = {
                "model": "tiny",
                "prompt": "hello",
                "max_tokens": 40,
                "ignore_eos": True,
                "vllm_xargs": {"output_rate_user": user},
            }
            httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        threads = [threading.Thread(target=stream, args=(f"u{i}",)) for i in range(8)]
        for t in threads:
            t.start()
        time.sleep(3.0)  # every user spent its burst: all requests throttled
        before = cpu_by_role(process.popen.pid)
        time.sleep(WINDOW_S)
        after = cpu_by_role(process.popen.pid)
        return {role: (after[role] - before.get(role, 0.0)) / WINDOW_S * 100 for role in after}
    finally:
        process.kill()


def main() -> None:
    patched = measure(spin=False)
    upstream = measure(spin=True)
    rows = [
        "| process | patched idle wait (% of a core) | upstream 1 ms spin (% of a core) |",
        "|---|---|---|",
    ]
    for role in ("engine_core", "worker"):
        rows.append(f"| {role} | {patched.get(role, 0):.1f} | {upstream.get(role, 0):.1f} |")
    print("\n".join(rows))


if __name__ == "__main__":
    sys.exit(main())
