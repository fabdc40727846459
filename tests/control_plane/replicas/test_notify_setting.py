"""OUTPUT_RATE_REPLICA_NOTIFY: true or false, nothing else; off, a replica on PostgreSQL
holds no LISTEN or NOTIFY session (neither for config changes nor for the relay) and
finds the other replicas' writes by its polls (real PostgreSQL, a real served app)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from control_plane.app import create_served_app
from harness.control_plane import fresh_database
from tests.control_plane.factories import make_settings


@pytest.mark.parametrize(("raw", "parsed"), [("true", True), ("FALSE", False), (" false ", False)])
def test_the_setting_is_true_or_false(
    raw: str, parsed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTPUT_RATE_REPLICA_NOTIFY", raw)
    assert make_settings("sqlite://").replica_notify is parsed


@pytest.mark.parametrize("raw", ["yes", "0", "", "flase"])
def test_anything_else_is_refused_naming_it(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTPUT_RATE_REPLICA_NOTIFY", raw)
    with pytest.raises(ValidationError, match="OUTPUT_RATE_REPLICA_NOTIFY must be true or false"):
        make_settings("sqlite://")


def test_off_a_replica_holds_no_listen_or_notify_session(tmp_path: Path) -> None:
    with fresh_database("postgres", tmp_path) as url:
        settings = make_settings(
            url, replica_notify=False, zmq_endpoint="tcp://127.0.0.1:0", replica_id="r-quiet"
        )
        served = create_served_app(settings)
        served.start()
        try:
            assert served.listener is None and served.announcer is None
            assert served.relay is not None
            assert served.relay._listener is None and served.relay._announcer is None
        finally:
            served.close()
            served.db.dispose()
        on = create_served_app(make_settings(url, zmq_endpoint="tcp://127.0.0.1:0"))
        on.start()
        try:
            assert on.listener is not None and on.announcer is not None
        finally:
            on.close()
            on.db.dispose()
