"""A control-plane outage under each outage policy (docs/fleet.md, "Outage policy").

A control plane (SQLite) and two tiny-model vLLM engines; one user with a fleet limit
streaming on engine A only (so its whole limit is A's share). For each policy the control
plane is started with it, A's share reaches the whole limit, then the control plane is
killed (SIGKILL) for ``--outage-s``; the user's tokens/s on A are measured from the client
(token times of the stream, re-opened as each ends) while the shares' lease holds, through
the keep time ("keep"), and after it. The engines stay up; the next policy's control plane
takes over the same database and ports.

    python -m bench.outage_bench --outage-s 60
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from harness.client import run, stream_completion
from harness.servers import ControlPlane, fleet_engine, free_port

USER = "bench-outage-user"
AUTH = ControlPlane.auth_headers()


@dataclass
class Case:
    name: str
    env: dict[str, str]
    keep_s: float = 0.0
    # tokens/s the policy gives the user on A after the lease (and the keep)
    expected: float = 0.0


@dataclass
class Measured:
    case: Case
    before: float  # control plane up, A holding the whole limit
    lease: float  # killed, the lease still holds
    keep: float | None  # the keep time ("keep" only)
    after: float  # the outage share


def rate(times: list[float], start: float, end: float) -> float:
    """Tokens per second between two instants (tokens counted between them)."""
    return sum(start <= t <= end for t in times) / (end - start)


async def share_of_a(client: httpx.AsyncClient, cp: ControlPlane) -> float:
    response = await client.get(f"{cp.url}/limits/{USER}", headers=AUTH)
    shares = response.json().get("shares", [])
    return next((s["output_tokens_per_second"] for s in shares if s["engine_id"] == "a"), 0.0)


async def one_case(
    cp: ControlPlane, a_url: str, case: Case, *, limit: int, lease_s: float, outage_s: float
) -> Measured:
    times: list[float] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=300) as client:

        async def stream_on_a() -> None:
            while not stop.is_set():
                result = await stream_completion(client, a_url, user=USER, max_tokens=120)
                times.extend(result.token_times)

        streaming = asyncio.ensure_future(stream_on_a())
        deadline = time.monotonic() + 60 + case.keep_s
        while await share_of_a(client, cp) != limit:
            assert time.monotonic() < deadline, "A never held the whole limit"
            await asyncio.sleep(0.2)
        held_at = time.monotonic()
        await asyncio.sleep(6.0)
        killed_at = time.monotonic()
        cp.kill(signal.SIGKILL)
        await asyncio.sleep(outage_s)
        ended_at = time.monotonic()
        stop.set()
        await streaming
    lease_end = killed_at + lease_s
    keep_end = lease_end + case.keep_s
    return Measured(
        case,
        before=rate(times, held_at + 1.0, killed_at),
        lease=rate(times, killed_at, lease_end - 0.2),
        keep=rate(times, lease_end + 0.5, keep_end - 0.2) if case.keep_s else None,
        after=rate(times, keep_end + 0.5, ended_at),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--outage-s", type=float, default=60.0)
    parser.add_argument("--keep-s", type=float, default=20.0)
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--lease-s", type=float, default=2.0)
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument(
        "--policies", default="serving,keep,fraction", help="which, comma-separated, in order"
    )
    args = parser.parse_args()
    lease, limit = args.lease_s, args.limit
    cases = [
        Case("serving", {"OUTPUT_RATE_OUTAGE_POLICY": "serving"}, expected=limit),
        Case(
            f"keep ({args.keep_s:g} s)",
            {"OUTPUT_RATE_OUTAGE_POLICY": "keep", "OUTPUT_RATE_OUTAGE_KEEP_S": str(args.keep_s)},
            keep_s=args.keep_s,
            expected=limit,
        ),
        Case(
            f"fraction ({args.fraction:g})",
            {
                "OUTPUT_RATE_OUTAGE_POLICY": "fraction",
                "OUTPUT_RATE_OUTAGE_FRACTION": str(args.fraction),
            },
            expected=args.fraction * limit,
        ),
    ]
    chosen = args.policies.split(",")
    cases = [case for case in cases if case.name.split()[0] in chosen]
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        db_url = f"sqlite:///{tmp / 'cp.db'}"
        port, zmq_port = free_port(), free_port()

        def control_plane(case: Case) -> ControlPlane:
            gone_after = 2 * lease + case.keep_s + 1.0
            cp = ControlPlane(
                tmp / f"cp-{case.name.split()[0]}.log",
                db_url,
                port,
                zmq_port,
                extra_env={
                    "OUTPUT_RATE_SHARE_LEASE_S": str(lease),
                    "OUTPUT_RATE_SHARE_GONE_AFTER_S": str(gone_after),
                    **case.env,
                },
            )
            cp.wait_ready()
            return cp

        cp = control_plane(cases[0])
        engines = [fleet_engine(tmp, cp, name) for name in ("a", "b")]
        results: list[Measured] = []
        try:
            for engine in engines:
                engine.wait_ready()
            cp.wait_applied(cp.put(USER, limit))
            for i, case in enumerate(cases):
                if i:
                    cp = control_plane(case)
                measured = run(
                    one_case(
                        cp, engines[0].url, case, limit=limit, lease_s=lease, outage_s=args.outage_s
                    )
                )
                results.append(measured)
                keep = "" if measured.keep is None else f", keep {measured.keep:.1f}"
                print(
                    f"{case.name}: before {measured.before:.1f}, lease {measured.lease:.1f}"
                    f"{keep}, after {measured.after:.1f} tokens/s (limit {limit})",
                    flush=True,
                )
        finally:
            for engine in engines:
                engine.kill()
            cp.kill()
    print()
    print(
        "| policy | control plane up | killed, lease holding | keep time | outage share "
        "(measured) | policy's value | before this change |"
    )
    print("|---|---|---|---|---|---|---|")
    for m in results:
        keep = "" if m.keep is None else f"{m.keep:.1f}"
        print(
            f"| {m.case.name} | {m.before:.1f} | {m.lease:.1f} | {keep} | {m.after:.1f} "
            f"({100 * m.after / limit:.0f} % of L) | {m.case.expected:g} | {limit / 2:g} (L / 2) |"
        )


if __name__ == "__main__":
    main()
