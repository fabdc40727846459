"""Where `Database.write` runs a write, on a real database file or server."""

from __future__ import annotations

import asyncio
import resource
import threading

from sqlalchemy import Connection

from control_plane.db import Commit, ConfigChange, Database, make_engine
from control_plane.limits import service as limits
from tests.control_plane.factories import writers_lock_held


def _put(conn: Connection, *, user: str, rate: int) -> ConfigChange[tuple[str, int]]:
    """put_limit, and the thread it ran on."""
    change = limits.put_limit(conn, actor="test", user=user, rate=rate, tier=None)
    return ConfigChange((threading.current_thread().name, change.result.version), change.commit)


def test_small_write_runs_on_the_loop_when_the_lock_is_free(db_url: str) -> None:
    db = Database(make_engine(db_url))
    seen: list[Commit] = []
    db.on_commit.append(seen.append)

    async def main() -> tuple[str, int]:
        return (await db.write(_put, user="alice", rate=5)).result

    thread, version = asyncio.run(main())
    # SQLite: on the event loop's own thread; PostgreSQL (a network round trip): the
    # writer thread.
    expected = "MainThread" if db_url.startswith("sqlite") else "output-rate-writer"
    assert thread.startswith(expected)
    assert [commit.version for commit in seen] == [version]
    db.dispose()


def test_write_queues_on_the_writer_thread_while_another_connection_holds_the_lock(
    db_url: str,
) -> None:
    db = Database(make_engine(db_url))
    seen: list[Commit] = []
    db.on_commit.append(seen.append)

    async def main() -> tuple[str, int]:
        await db.write(_put, user="alice", rate=5)  # the server is up (and SQLite in WAL)
        with writers_lock_held(db_url) as conn:
            write = asyncio.ensure_future(db.write(_put, user="bob", rate=7))
            # The loop is not blocked: it keeps running other work while the write waits.
            for _ in range(20):
                await asyncio.sleep(0.01)
            assert not write.done()
            conn.rollback()
        return (await asyncio.wait_for(write, timeout=60)).result

    thread, version = asyncio.run(main())
    assert thread.startswith("output-rate-writer")
    assert [commit.version for commit in seen] == [version - 1, version]
    # The no-wait attempt left the pooled connections with the normal busy timeout.
    if db_url.startswith("sqlite"):
        with db.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000
    db.dispose()


def test_reads_after_an_inline_write_do_not_take_the_write_lock(db_url: str) -> None:
    """The loop's own connection wrote last; its next reads are plain reads, so they go
    on while another connection holds the write lock."""
    db = Database(make_engine(db_url))

    async def main() -> list[int | None]:
        await db.write(_put, user="alice", rate=5)
        with writers_lock_held(db_url) as conn:
            rates = []
            for _ in range(3):
                view = await asyncio.wait_for(db.read(limits.get_limit, user="alice"), 10)
                rates.append(view.effective_output_tokens_per_second)
            conn.rollback()
        return rates

    assert asyncio.run(main()) == [5, 5, 5]
    db.dispose()


# A process with every file descriptor taken, after `open_connections`: a bulk write (the
# writer thread), a small write (the loop on SQLite) and a usage flush (its own thread,
# from the pool) still commit, and no descriptor came free meanwhile.
NO_FILES_LEFT = """
import asyncio, json, os, sys, threading
from control_plane.db import Database, make_engine
from control_plane.limits import service as limits
from control_plane.limits.plans import UserItem
from control_plane.usage import service as usage
from output_rate_core.policy import Policy

db = Database(make_engine(sys.argv[1]))
db.open_connections()
loop = asyncio.new_event_loop()
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
items = [UserItem(user=f"bulk-{i}", tier=None, policy=Policy(5)) for i in range(10_000)]
bulk = loop.run_until_complete(db.run(limits.bulk_put_limits, actor="t", items=items))
put = loop.run_until_complete(
    db.run(limits.put_limit, actor="t", user="one", rate=7, tier=None)
)
flush = threading.Thread(
    target=db.run_now, args=(usage.record_usage,), kwargs={"counts": {("one", 0): (5, 1)}}
)
flush.start()
flush.join()
try:
    os.open(os.devnull, os.O_RDONLY)
    still_full = False
except OSError:
    still_full = True
print(json.dumps([len(held), bulk.result.num_changed, put.result.version, still_full]))
"""


def test_writes_commit_with_no_file_descriptor_left(db_url: str) -> None:
    import json
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", NO_FILES_LEFT, db_url],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)),
    )
    assert run.returncode == 0, run.stderr
    num_held, num_changed, version, still_full = json.loads(run.stdout)
    assert num_held > 100 and still_full
    assert (num_changed, version) == (10_000, 2)
    db = Database(make_engine(db_url))
    assert db.read_now(limits.get_limit, user="one").output_tokens_per_second == 7
    assert db.read_now(limits.get_limit, user="bulk-9999").output_tokens_per_second == 5
    db.dispose()
