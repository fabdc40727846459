"""--control-plane-endpoint: one or more control-plane replicas, checked at startup."""

from __future__ import annotations

import argparse

import pytest

from engine_ext.config import OutputRateConfig
from engine_ext.flags import FLAGS, add_flags, config_from_args, parse_endpoint


@pytest.mark.parametrize(
    ("text", "endpoints"),
    [
        ("tcp://127.0.0.1:5557", ("tcp://127.0.0.1:5557",)),
        ("tcp://cp-a:5557,tcp://cp-b:5557", ("tcp://cp-a:5557", "tcp://cp-b:5557")),
        (
            "tcp://cp-a.internal:1,tcp://[::1]:65535,ipc:///run/cp.sock",
            ("tcp://cp-a.internal:1", "tcp://[::1]:65535", "ipc:///run/cp.sock"),
        ),
        ("tcp://[2001:db8::7]:5557", ("tcp://[2001:db8::7]:5557",)),
    ],
)
def test_replicas_are_kept_in_order(text: str, endpoints: tuple[str, ...]) -> None:
    assert parse_endpoint(text) == endpoints


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "without spaces"),
        ("http://cp:5557", "'http://cp:5557' is no ZMQ endpoint: must be tcp://host:port"),
        ("tcp://cp-a:5557,", "empty entry"),
        (",tcp://cp-a:5557", "empty entry"),
        ("tcp://cp-a:5557,,tcp://cp-b:5557", "empty entry"),
        ("tcp://cp-a:5557, tcp://cp-b:5557", "without spaces"),
        ("tcp://cp-a:5557 ", "without spaces"),
        ("tcp://cp-a:5557,tcp://cp-b:5557,tcp://cp-a:5557", "names 'tcp://cp-a:5557' twice"),
        ("tcp://cp-a", "needs host:port"),
        ("tcp://:5557", "needs host:port"),
        ("tcp://cp-a:0", "port must be 1..65535"),
        ("tcp://cp-a:65536", "port must be 1..65535"),
        ("tcp://cp-a:+1", "port must be 1..65535"),
        ("tcp://cp-a:http", "port must be 1..65535"),
        ("tcp://::1:5557", "IPv6 address goes in brackets"),
        ("tcp://[cp-a]:5557", "[cp-a] is no IPv6 address"),
        ("tcp://*:5557", "'*' is no host name"),
        ("tcp://eth0;cp-a:5557", "is no host name"),
        ("tcp://cp-a:5557;tcp://cp-b:5557", "'cp-a:5557;tcp://cp-b' is no host name"),
        ("ipc://", "needs a socket path"),
        ("udp://cp-a:5557", "must be tcp://host:port or ipc://path"),
    ],
)
def test_malformed_replica_lists_are_refused(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        parse_endpoint(text)
    assert message in str(refused.value)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser)
    return parser


def test_the_refusal_names_the_flag() -> None:
    flag = FLAGS["control_plane_endpoint"]
    with pytest.raises(argparse.ArgumentError) as refused:
        parser().parse_args([flag, "tcp://cp-a:5557,,tcp://cp-b:5557"])
    assert flag in str(refused.value)
    assert "empty entry" in str(refused.value)


def test_the_replicas_reach_the_config_and_survive_its_round_trip() -> None:
    flag = FLAGS["control_plane_endpoint"]
    args = parser().parse_args([flag, "tcp://cp-a:5557,tcp://cp-b:5557"])
    config = config_from_args(args)
    assert config.control_plane_endpoints == ("tcp://cp-a:5557", "tcp://cp-b:5557")
    assert config.enabled
    # additional_config may hand it back as a list (a JSON round trip).
    data = {**config.to_dict(), "control_plane_endpoints": ["tcp://cp-a:5557", "tcp://cp-b:5557"]}
    assert OutputRateConfig.from_dict(data) == config
    assert not config_from_args(parser().parse_args([])).enabled
