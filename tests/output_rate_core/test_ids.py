"""One set of id rules (output_rate_core/ids.py) for REST, bulk, the protocol, the vLLM flags
and the database columns."""

from __future__ import annotations

import argparse

import pytest

from control_plane.models import Engine, UserLimit
from engine_ext.flags import add_flags, config_from_args, default_engine_id
from output_rate_core import ids
from output_rate_core import protocol as p


@pytest.mark.parametrize("good", ["...", ".hidden", "a.b", "..x", "x..", "ü ser", "a" * 256])
def test_user_ids_with_dots_that_a_url_keeps_are_fine(good: str) -> None:
    assert ids.check_user_id(good) == good
    assert p.decode(p.encode(p.Usage("e1", 1.0, {good: 1}, {}))).granted == {good: 1}


def test_column_lengths_are_the_id_rules() -> None:
    assert Engine.__table__.c.engine_id.type.length == ids.MAX_ENGINE_ID_LEN  # type: ignore[attr-defined]
    assert Engine.__table__.c.model.type.length == ids.MAX_MODEL_LEN  # type: ignore[attr-defined]
    assert UserLimit.__table__.c.user.type.length == ids.MAX_USER_ID_LEN  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "bad", ["", "a/b", "nul\x00", "tab\t", "\ufffd", "x" * 257, ".", "..", "newline\n"]
)
def test_bad_user_ids_are_refused_everywhere(bad: str) -> None:
    with pytest.raises(ValueError):
        ids.check_user_id(bad)
    assert not ids.is_user_id(bad)
    with pytest.raises(p.ProtocolError):
        p.decode(p.encode(p.Usage("e1", 1.0, {bad: 1}, {})))


@pytest.mark.parametrize(
    "good", ["e1", "host:8000", "[::1]:8000", "vllm-0.ns_1@zone", "...", ".a", "a.", ".a."]
)
def test_engine_ids(good: str) -> None:
    assert ids.check_engine_id(good) == good
    assert p.decode(p.encode(p.Hello(good, "org/model", 0))) == p.Hello(good, "org/model", 0)


@pytest.mark.parametrize("bad", ["", "a/b", "a b", "nul\x00", "x" * 257, "é", ".", "..", "e1\n"])
def test_bad_engine_ids_are_refused_by_protocol_and_flag(bad: str) -> None:
    with pytest.raises(ValueError):
        ids.check_engine_id(bad)
    for message in (p.Hello(bad, "m", 0), p.Heartbeat(0, bad, "m"), p.Ack(bad, 1)):
        if isinstance(message, p.Heartbeat) and not bad:
            continue  # the server's heartbeats carry no engine id
        with pytest.raises(p.ProtocolError):
            p.decode(p.encode(message))
    parser = argparse.ArgumentParser()
    add_flags(parser)
    if bad:
        with pytest.raises(SystemExit):
            parser.parse_args(["--output-rate-engine-id", bad])


def test_models_are_bounded_and_the_default_engine_id_is_checked() -> None:
    with pytest.raises(p.ProtocolError):
        p.decode(p.encode(p.Hello("e1", "m" * (ids.MAX_MODEL_LEN + 1), 0)))
    with pytest.raises(p.ProtocolError):
        p.decode(p.encode(p.Heartbeat(0, "e1", "bad\x00model")))
    parser = argparse.ArgumentParser()
    add_flags(parser)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    # The default id is the machine's name and the port, whatever --host binds.
    for host in ("10.0.0.1", "bad host"):
        config = config_from_args(parser.parse_args(["--host", host, "--port", "8000"]))
        assert config.engine_id == default_engine_id(8000)
        assert ids.check_engine_id(config.engine_id)
