"""What every benchmark here does the same way: percentiles of its samples, clients
writing from threads at once, and its report written to bench/results (or, with
`--out -`, only printed)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def concurrent_writes(
    *, threads: int, writes: int, write: Callable[[int, int], None]
) -> tuple[float, list[float]]:
    """(writes/s, each write's seconds) of `threads` clients, client i calling write(i, k)
    for k in range(writes), all at once."""
    latencies: list[float] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        mine = []
        for k in range(writes):
            started = time.perf_counter()
            write(index, k)
            mine.append(time.perf_counter() - started)
        with lock:
            latencies.extend(mine)

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(client, range(threads)))
    return threads * writes / (time.perf_counter() - started), latencies


def write_report(text: str, out: str) -> None:
    """Print the report and, unless `out` is "-", write it there."""
    if out != "-":
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    print(text)


def write_section(text: str, out: str) -> None:
    """Print the report and, unless `out` is "-", put it in `out` in place of the section
    with the same first line (a `# ` heading, up to the next one outside code), or after the others:
    benchmarks that share a results file keep each other's sections."""
    print(text)
    if out == "-":
        return
    path = Path(out)
    sections: list[list[str]] = []
    in_code = False
    for line in path.read_text().splitlines() if path.exists() else ():
        in_code ^= line.startswith("```")
        if (line.startswith("# ") and not in_code) or not sections:
            sections.append([])
        sections[-1].append(line)
    parts = ["\n".join(s).strip("\n") for s in sections]
    new = text.strip("\n")
    heading = new.splitlines()[0]
    at = next((i for i, s in enumerate(sections) if s[0] == heading), None)
    if at is None:
        parts.append(new)
    else:
        parts[at] = new
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(p for p in parts if p) + "\n")
