"""VTC's fairness metrics (Sheng et al., "Fairness in Serving Large Language Models")
on the real scheduler: upstream FCFS, upstream priority, hard limits, borrowing.

The real vLLM scheduler and KV manager with hand-built model outputs and a fake clock
(STEP_MS per step, one token per scheduled stream per step: 8 active slots make an
engine of 400 tok/s), as in bench/borrow_bench.py. Clients are closed loops: while on,
each keeps its streams' requests outstanding (a finished request is replaced in the
next step), output lengths drawn from a seeded generator, so they are backlogged. A
victim, a light user (one request of 32 tokens every 2 s on average, Poisson), runs
beside them and alone.

Weights are the users' rates: weighted service = output tokens / rate, in seconds of
service at the user's own rate. The service difference at time t is the largest minus
the smallest weighted service among the clients backlogged (a request outstanding at
every step) throughout the interval: [0, t] ("over time", cumulative) or the 60 s before
t (sliding windows); sampled every second, its maximum and mean are reported.

Schedulers: upstream FCFS; upstream priority with one priority per rate (higher rate
first, as an operator would map tiers); the plugin with the rates as hard limits; the
plugin with the same rates and a ceiling no engine reaches (borrowing) for every client
but the victim.

Run: flock /tmp/vllm-heavy.lock .venv/bin/python -m bench.vtc_bench [--seconds 300]
"""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.borrow_bench import HIGH, scheduler
from bench.report import pct, write_section
from harness.scheduler import FakeClock, drive, make_request, make_scheduler

STEP_MS = 20
NUM_ACTIVE = 8  # engine pace: NUM_ACTIVE tokens per step
NUM_SEQS = 64  # worker slots: every stream of every client can be admitted
WINDOW_S = 60
VICTIM = "victim"
VICTIM_RATE = 200  # never binds: one stream runs at 50 tok/s, rarely two at once
VICTIM_TOKENS = 32
VICTIM_GAP_S = 2.0
POLICIES = {
    "fcfs": "upstream FCFS",
    "priority": "upstream priority",
    "hard": "hard limits",
    "borrow": "borrowing",
}


@dataclass(frozen=True)
class Client:
    """A closed loop: ``num_streams`` requests outstanding while on (``on``: spans of
    the run, as fractions of it), each of ``min_tokens`` to ``max_tokens`` tokens."""

    name: str
    rate: int  # tok/s: its limit, and its weight
    num_streams: int = 6
    min_tokens: int = 64
    max_tokens: int = 192
    on: tuple[tuple[float, float], ...] = ((0.0, 1.0),)

    def is_on(self, fraction: float) -> bool:
        return any(start <= fraction < end for start, end in self.on)


@dataclass(frozen=True)
class Workload:
    description: str
    clients: tuple[Client, ...]


EIGHT_RATES = (15, 15, 30, 30, 45, 45, 60, 60)
WORKLOADS = {
    "two": Workload(
        "2 backlogged clients, rates 100 and 100, 6 and 12 streams",
        (Client("a", 100, 6), Client("b", 100, 12)),
    ),
    "eight": Workload(
        "8 backlogged clients, rates 15, 15, 30, 30, 45, 45, 60, 60, 6 streams each",
        tuple(Client(f"u{i}", rate) for i, rate in enumerate(EIGHT_RATES)),
    ),
    "eight reversed": Workload(
        "the same, rates 60, 60, 45, 45, 30, 30, 15, 15 (u0 now the fastest)",
        tuple(Client(f"u{i}", rate) for i, rate in enumerate(reversed(EIGHT_RATES))),
    ),
    "on/off": Workload(
        "a (50) and b (100) always on; c (50) and d (100) off, on from 20 % to 50 % of "
        "the run, off, on from 70 % to the end; 6 streams each",
        (
            Client("a", 50),
            Client("b", 100),
            Client("c", 50, on=((0.2, 0.5), (0.7, 1.0))),
            Client("d", 100, on=((0.2, 0.5), (0.7, 1.0))),
        ),
    ),
    "lengths": Workload(
        "2 backlogged clients, rates 100 and 100, outputs of 16-48 (short) and "
        "384-640 (long) tokens, 8 streams each",
        (
            Client("short", 100, 8, 16, 48),
            Client("long", 100, 8, 384, 640),
        ),
    ),
}


@dataclass
class Run:
    tokens: np.ndarray  # [client, step]: tokens sampled
    num_victim_tokens: int
    backlogged: np.ndarray  # [client, step]: a request outstanding when the step began
    ttft_ms: list[float]  # the victim's (a request without a token: a lower bound)
    tpot_ms: list[float]
    wall_s: float

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.sum()) + self.num_victim_tokens


def priorities(rates: dict[str, int]) -> dict[str, int]:
    """One priority per rate, the highest rate first (vLLM serves lower values first)."""
    tiers = sorted(set(rates.values()), reverse=True)
    return {user: tiers.index(rate) for user, rate in rates.items()}


def build(policy: str, rates: dict[str, int], clock: FakeClock) -> Any:
    if policy in ("fcfs", "priority"):
        return make_scheduler(
            limited=False,
            clock=clock,
            scheduler_options={"policy": policy},
            max_num_seqs=NUM_SEQS,
            max_num_active_seqs=NUM_ACTIVE,
        )
    ceilings = {user: HIGH for user in rates if user != VICTIM} if policy == "borrow" else {}
    return scheduler(
        dict(rates), ceilings, clock, max_num_seqs=NUM_SEQS, max_num_active_seqs=NUM_ACTIVE
    )


def victim_arrivals(seconds: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    arrivals, now = [], rng.expovariate(1 / VICTIM_GAP_S)
    while now < seconds:
        arrivals.append(now)
        now += rng.expovariate(1 / VICTIM_GAP_S)
    return arrivals


def simulate(clients: tuple[Client, ...], policy: str, seconds: float, seed: int = 0) -> Run:
    """``clients`` and the victim under ``policy`` for ``seconds`` of fake clock."""
    num_steps = round(seconds * 1000 / STEP_MS)
    step_ns = STEP_MS * 1_000_000
    rates = {c.name: c.rate for c in clients} | {VICTIM: VICTIM_RATE}
    priority = priorities(rates)
    clock = FakeClock()
    start_ns = clock()
    sched = build(policy, rates, clock)
    rngs = [random.Random(seed * 1000 + i) for i in range(len(clients))]
    live: list[set[str]] = [set() for _ in clients]
    num_sent = [0] * len(clients)
    backlogged = np.zeros((len(clients), num_steps), dtype=bool)
    arrivals = victim_arrivals(seconds, seed)
    victim_sent: dict[str, int] = {}  # request id -> arrival ns

    def send(user: str, request_id: str, max_tokens: int, now_s: float) -> None:
        request = make_request(
            user,
            max_tokens=max_tokens,
            request_id=request_id,
            priority=priority[user],
            arrival_time=now_s,
        )
        sched.add_request(request)

    def on_step(step: int) -> None:
        now_s = step * STEP_MS / 1000
        for i, client in enumerate(clients):
            mine = live[i] = {r for r in live[i] if r in sched.requests}
            while client.is_on(now_s / seconds) and len(mine) < client.num_streams:
                request_id = f"{client.name}-{num_sent[i]}"
                num_sent[i] += 1
                send(
                    client.name,
                    request_id,
                    rngs[i].randint(client.min_tokens, client.max_tokens),
                    now_s,
                )
                mine.add(request_id)
            backlogged[i, step] = bool(mine)
        while len(victim_sent) < len(arrivals) and arrivals[len(victim_sent)] <= now_s:
            request_id = f"{VICTIM}-{len(victim_sent)}"
            victim_sent[request_id] = start_ns + step * step_ns
            send(VICTIM, request_id, VICTIM_TOKENS, now_s)

    started = time.perf_counter()
    trace = drive(sched, num_steps=num_steps, clock=clock, step_ms=STEP_MS, on_step=on_step)
    wall_s = time.perf_counter() - started
    index = {c.name: i for i, c in enumerate(clients)}
    tokens = np.zeros((len(clients), num_steps), dtype=np.int64)
    victim_times: dict[str, list[int]] = {r: [] for r in victim_sent}
    for t, request_id in trace.samples:
        if request_id in victim_times:
            victim_times[request_id].append(t)
        else:
            tokens[index[request_id.rsplit("-", 1)[0]], (t - start_ns) // step_ns] += 1
    end_ns = start_ns + num_steps * step_ns
    ttft, tpot = [], []
    for request_id, times in victim_times.items():
        # A token sampled in the step that starts at t is out at its end.
        first = times[0] + step_ns if times else end_ns
        ttft.append((first - victim_sent[request_id]) / 1e6)
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1) / 1e6)
    num_victim = sum(map(len, victim_times.values()))
    return Run(tokens, num_victim, backlogged, ttft, tpot, wall_s)


def service_difference(
    run: Run, clients: tuple[Client, ...], window_s: float | None
) -> tuple[float, float]:
    """(max, mean) over the samples, one a second, of the weighted service difference
    among the clients backlogged throughout the interval before the sample: since the
    start (``window_s=None``) or the last ``window_s`` seconds. NaN if never two."""
    num_steps = run.tokens.shape[1]
    per_s = 1000 // STEP_MS
    weights = np.array([c.rate for c in clients], dtype=float)[:, None]
    # served[:, k]: weighted service before step k.
    served = np.concatenate([np.zeros((len(clients), 1)), np.cumsum(run.tokens, axis=1)], axis=1)
    served /= weights
    steps = np.arange(num_steps)
    last_idle = np.maximum.accumulate(np.where(run.backlogged, -1, steps), axis=1)
    window = None if window_s is None else round(window_s * per_s)
    differences = []
    for end in range(per_s, num_steps + 1, per_s):
        start = 0 if window is None else end - window
        if start < 0:
            continue
        eligible = last_idle[:, end - 1] < start
        if eligible.sum() >= 2:
            got = served[eligible, end] - served[eligible, start]
            differences.append(float(got.max() - got.min()))
    if not differences:
        return math.nan, math.nan
    return max(differences), sum(differences) / len(differences)


def p99(values: list[float]) -> float:
    return pct(values, 99) if values else math.nan  # NaN: none (a short run)


def ratio(value: float, alone: float) -> str:
    return f"{value:.1f} / {alone:.1f} = {value / alone:.2f}x"


def report(seconds: float, seed: int) -> str:
    num_steps = round(seconds * 1000 / STEP_MS)
    alone = {policy: simulate((), policy, seconds, seed) for policy in POLICIES}
    walls = [run.wall_s for run in alone.values()]
    lines = [
        "# VTC fairness metrics (scheduler level)",
        "",
        f"`flock /tmp/vllm-heavy.lock .venv/bin/python -m bench.vtc_bench --seconds "
        f"{seconds:g} --seed {seed}`: the real vLLM scheduler (sync), hand-built model "
        f"outputs, a fake clock of {STEP_MS} ms per step ({num_steps} steps), "
        f"{NUM_ACTIVE} active slots (engine pace {NUM_ACTIVE * 1000 // STEP_MS} tok/s), "
        f"{NUM_SEQS} worker slots. Closed-loop clients (each keeps its streams' requests "
        "outstanding while on; output lengths drawn from a seeded generator), 8-token "
        f"prompts. The victim: rate {VICTIM_RATE}, no ceiling, one request of "
        f"{VICTIM_TOKENS} tokens every {VICTIM_GAP_S:g} s on average (Poisson, the same "
        "arrivals in every run), beside the clients and alone under the same scheduler.",
        "",
        "Weighted service = output tokens / the user's rate (seconds of service at its "
        "own rate). Difference = largest - smallest weighted service among the clients "
        "backlogged throughout the interval, sampled every second: over time (since the "
        f"start) and in sliding {WINDOW_S} s windows; max and mean of the samples. "
        "Upstream priority: one priority per rate, higher rates first (the victim, at "
        f"{VICTIM_RATE}, is always in the top tier). Borrowing: every client but the "
        "victim has a ceiling of "
        f"{HIGH:,}. Victim TTFT and TPOT p99 in ms of fake clock, beside / alone; a TTFT "
        "of a request without a token by the end counts as its wait so far.",
    ]
    for name, workload in WORKLOADS.items():
        clients = workload.clients
        runs = {policy: simulate(clients, policy, seconds, seed) for policy in POLICIES}
        fcfs_total = runs["fcfs"].num_tokens
        lines += [
            "",
            f"## {name}: {workload.description}",
            "",
            "| scheduler | tok/s (x FCFS) | diff over time max / mean (s) | "
            f"diff {WINDOW_S} s windows max / mean (s) | victim TTFT p99 (ms) | "
            "victim TPOT p99 (ms) | tok/s per client |",
            "|---|---|---|---|---|---|---|",
        ]
        for policy, run in runs.items():
            cum = service_difference(run, clients, None)
            win = service_difference(run, clients, WINDOW_S)
            per_client = ", ".join(
                f"{c.name} {n / seconds:.0f}"
                for c, n in zip(clients, run.tokens.sum(axis=1), strict=True)
            )
            lines.append(
                f"| {POLICIES[policy]} | {run.num_tokens / seconds:.0f} "
                f"({run.num_tokens / fcfs_total:.2f}) | {cum[0]:.1f} / {cum[1]:.1f} | "
                f"{win[0]:.1f} / {win[1]:.1f} | "
                f"{ratio(p99(run.ttft_ms), p99(alone[policy].ttft_ms))} | "
                f"{ratio(p99(run.tpot_ms), p99(alone[policy].tpot_ms))} | "
                f"{per_client} |"
            )
        walls.extend(run.wall_s for run in runs.values())
    lines += [
        "",
        f"Wall time of the {len(walls)} runs (this 2-core machine, shared): "
        f"{sum(walls):.0f} s, the longest {max(walls):.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/borrow.md", help='"-": print only')
    args = parser.parse_args()
    write_section(report(args.seconds, args.seed), args.out)


if __name__ == "__main__":
    main()
