"""Live usage shared through PostgreSQL (control_plane/replicas/live_usage.py): real
database rows, real books; the books' clock is a fake one (the one seam), the rows' ages
are the database's. What a replica shows is what one book holding every report shows."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from sqlalchemy import create_engine, func, inspect, select, text

from control_plane import fencing
from control_plane.cli import downgrade, upgrade
from control_plane.db import Database, make_engine
from control_plane.models import LiveUsageRow, table
from control_plane.replicas import lease
from control_plane.replicas.live_usage import FleetUsage, decode_window, encode_window
from control_plane.usage.book import UsageBook
from harness.control_plane import fresh_database
from output_rate_core import protocol as p
from tests.control_plane.factories import FakeClock


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    with fresh_database("postgres", tmp_path) as made:
        yield made


@pytest.fixture
def dbs(url: str) -> Iterator[list[Database]]:
    made = [Database(make_engine(url)) for _ in range(3)]
    yield made
    for db in made:
        db.dispose()


def replicas(dbs: list[Database], clock: FakeClock) -> list[tuple[UsageBook, FleetUsage]]:
    out = []
    for name, db in zip("abc", dbs, strict=True):
        book = UsageBook(clock)
        out.append((book, FleetUsage(db, book, replica_id=f"r-{name}", clock=clock)))
    return out


def num_rows(db: Database) -> int:
    return db.read_now(
        lambda conn: conn.execute(
            select(func.count()).select_from(table(LiveUsageRow))
        ).scalar_one()
    )


def test_every_replica_shows_what_one_book_of_all_reports_shows(dbs: list[Database]) -> None:
    clock = FakeClock()
    (book_a, a), (book_b, b), (_, c) = replicas(dbs, clock)
    single = UsageBook(clock)
    # e1, e2 on a, e3 on b; e4 reported to a, then moved to b (both hold some of its
    # reports: one engine's window, not two rates).
    for second in range(8):
        clock.now += 1.0
        reports = [
            (book_a, p.Usage("e1", 1.0, {"x": 20, "y": 3}, {"x": 10}, borrowed={"x": 6})),
            (book_a, p.Usage("e2", 0.5, {"x": 4}, {}, would_throttle={"x": 2})),
            (book_b, p.Usage("e3", 1.0, {"y": 7 + second}, {"z": 5})),
            (book_a if second < 4 else book_b, p.Usage("e4", 1.0, {"x": 30}, {})),
        ]
        for book, report in reports:
            assert book.add(report)
            assert single.add(report)
    for _ in range(2):  # a reads b's rows at its second write
        for replica in (a, b, c):
            replica.share_once()
    expected = single.totals()
    assert [u.borrowed_per_s_10s for u in expected if u.user == "x"] == [pytest.approx(6.0)]
    for replica in (a, b, c):
        assert replica.totals() == pytest.approx(expected)
        for user in ("x", "y", "z", "nobody"):
            assert replica.rate_1s(user) == pytest.approx(single.rate_1s(user))
        # Ages of other replicas' engines: plus the time since their row was written
        # (the database's clock).
        assert replica.report_ages() == pytest.approx(single.report_ages(), abs=0.5)
    # One row per engine and replica holding its reports (e4 on both); c wrote none.
    assert num_rows(dbs[0]) == 5
    assert (a.num_rows_written, b.num_rows_written, c.num_rows_written) == (6, 4, 0)
    assert (a.num_transactions, b.num_transactions, c.num_transactions) == (2, 2, 2)
    # Once the window is past, each replica's rows go at its next write (the fake clock
    # jumps: the database's does not, so every replica writes before any reads again).
    clock.now += 11.0
    a.share_once()
    assert num_rows(dbs[0]) == 2
    b.share_once()
    assert num_rows(dbs[0]) == 0
    for replica in (a, b, c):
        replica.share_once()
        assert replica.totals() == single.totals() == []


class _ReportBeforeBorrowing(msgspec.Struct, array_like=True, frozen=True):
    age: float
    interval_s: float
    tokens: int
    granted: dict[str, int]
    throttled: dict[str, int]
    would_throttle: dict[str, int]


class _WindowBeforeBorrowing(msgspec.Struct, array_like=True, frozen=True):
    last_report_age: float
    reports: list[_ReportBeforeBorrowing]


def test_replicas_of_builds_before_borrowing_read_and_write_windows_both_ways() -> None:
    clock = FakeClock()
    book = UsageBook(clock)
    clock.now += 1.0
    book.add(p.Usage("e1", 1.0, {"x": 20}, {"x": 2}, would_throttle={"x": 1}, borrowed={"x": 5}))
    at, windows = book.windows()
    body = encode_window(windows["e1"])
    # An older replica reads the window less the borrowed tokens.
    old = msgspec.msgpack.decode(body, type=_WindowBeforeBorrowing)
    assert old.reports == [_ReportBeforeBorrowing(0.0, 1.0, 20, {"x": 20}, {"x": 2}, {"x": 1})]
    # Its window reads here as nothing borrowed.
    (report,) = decode_window("e1", msgspec.msgpack.encode(old), at).intervals[0].parts
    assert (report.granted, report.borrowed_counts) == ({"x": 20}, {})
    (report,) = decode_window("e1", body, at).intervals[0].parts
    assert report.borrowed_counts == {"x": 5}


def test_a_replica_that_stops_writing_stops_counting(dbs: list[Database]) -> None:
    clock = FakeClock()
    (book_a, a), (_, b), _ = replicas(dbs, clock)
    b = FleetUsage(dbs[1], b._book, replica_id="r-b", clock=clock, fresh_s=0.5)
    clock.now += 1.0
    book_a.add(p.Usage("e1", 1.0, {"x": 20}, {}))
    a.share_once()
    b.share_once()
    assert [u.user for u in b.totals()] == ["x"]
    time.sleep(0.8)  # a wrote nothing since (killed): its row is older than fresh_s
    b.share_once()
    assert b.totals() == []
    assert b.report_ages() == {}


def test_0009_adds_live_usage_and_api_homes_and_its_downgrade_keeps_engine_rows(
    db_url: str,
) -> None:
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO engines (engine_id, model, applied_version, connected,"
                    " first_seen, last_seen, api_home_replica)"
                    " VALUES ('e1', 'tiny', 3, true, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 'r')"
                )
            )
        downgrade(db_url, "0008")
        assert "live_usage" not in inspect(engine).get_table_names()
        columns = {c["name"] for c in inspect(engine).get_columns("engines")}
        assert not {"api_home_replica", "api_home_seen_at"} & columns
        upgrade(db_url)
        assert "live_usage" in inspect(engine).get_table_names()
        with engine.begin() as conn:
            row = conn.execute(
                text("SELECT engine_id, applied_version, api_home_replica FROM engines")
            ).one()
        assert tuple(row) == ("e1", 3, None)
    finally:
        engine.dispose()


class Allocator:
    """The leader's coordinator as the sharing thread reads it (its shares_table)."""

    def __init__(self, shares: dict[str, dict[str, int]], num_shared: dict[str, int]) -> None:
        self.table = (shares, num_shared)

    def shares_table(self) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
        return self.table


def test_followers_show_the_shares_of_the_leader_holding_the_lease(dbs: list[Database]) -> None:
    clock = FakeClock()
    first = dbs[0].run_now(lease.take_or_renew, name=fencing.LEADER, holder="r-a", ttl_s=30.0)
    assert first is not None
    terms: dict[str, fencing.Term | None] = {"r-a": fencing.Term(first, float("inf")), "r-b": None}
    allocators = {
        "r-a": Allocator({"u": {"e1": 15_000, "e2": 5_000}}, {"e1": 1, "e2": 1}),
        "r-b": Allocator({"u": {"e1": 40_000}}, {"e1": 1}),
    }

    def replica(db: Database, name: str) -> FleetUsage:
        return FleetUsage(
            db,
            UsageBook(clock),
            replica_id=name,
            clock=clock,
            term=lambda: terms[name],
            allocator=lambda: allocators[name],
        )

    a, b = replica(dbs[0], "r-a"), replica(dbs[1], "r-b")
    assert b.shares().shares_of("u") == {}
    a.share_once()
    b.share_once()
    assert b.shares().shares_of("u") == {"e1": 15_000, "e2": 5_000}
    assert (b.shares().num_shared_users("e2"), b.shares().num_shared_users("e9")) == (1, 0)
    # b takes the lease (a paused past its ttl); a's late write with its old token is
    # fenced: it writes nothing, and nobody shows its shares once b's are written.
    with dbs[0].engine.begin() as conn:
        conn.execute(text("UPDATE replica_leases SET expires_at = now() - interval '1 second'"))
    second = dbs[1].run_now(lease.take_or_renew, name=fencing.LEADER, holder="r-b", ttl_s=30.0)
    assert second == first + 1
    terms["r-b"] = fencing.Term(second, float("inf"))
    a.share_once()
    assert a.shares().shares_of("u") == {}  # no row of the token holding the lease yet
    b.share_once()
    a.share_once()
    assert a.shares().shares_of("u") == b.shares().shares_of("u") == {"e1": 40_000}
    # Shown only while fresh: a follower that read nothing since shows none.
    clock.now += 10.0
    assert a.shares().shares_of("u") == {}
