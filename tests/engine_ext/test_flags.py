"""--control-plane-endpoint: one or more control-plane replicas, checked at startup."""

from __future__ import annotations

import argparse
import socket

import pytest

from engine_ext.config import OutputRateConfig
from engine_ext.flags import FLAGS, add_flags, config_from_args, default_engine_id, parse_endpoint
from output_rate_core.ids import check_engine_id


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


def test_engines_on_one_host_get_ids_that_differ_by_port() -> None:
    # No --output-rate-engine-id: two servers on one machine, as every replica of a
    # Deployment that leaves --host unset (0.0.0.0) would be started.
    ids = [
        config_from_args(argparse.Namespace(host="0.0.0.0", port=port)).engine_id
        for port in (8000, 8001)
    ]
    assert ids == [f"{socket.gethostname()}:8000", f"{socket.gethostname()}:8001"]
    assert not any("0.0.0.0" in engine_id for engine_id in ids)


def test_the_default_id_is_the_machines_name_whatever_the_bind_address() -> None:
    bound = {
        config_from_args(argparse.Namespace(host=host, port=8000)).engine_id
        for host in (None, "0.0.0.0", "127.0.0.1", "::")
    }
    assert bound == {default_engine_id(8000)}
    # A name an engine id cannot hold as it is still gives a valid, stable id.
    assert default_engine_id(8000, hostname="pod 1/ä") == "pod-1--:8000"
    assert default_engine_id(None, hostname="..") == "localhost"
    long_id = default_engine_id(65535, hostname="h" * 300)
    assert OutputRateConfig(engine_id=long_id, data_parallel_size=2).engine_id_of_rank(1)
    check_engine_id(long_id + "-dp9999")


def test_an_explicit_engine_id_is_kept() -> None:
    flag = FLAGS["output_rate_engine_id"]
    args = parser().parse_args([flag, "engine-1"])
    args.port = 8000
    assert config_from_args(args).engine_id == "engine-1"


def test_ceilings_from_the_command_line_reach_the_config() -> None:
    args = parser().parse_args(
        [
            FLAGS["user_output_tokens_per_second"],
            '{"a": 20}',
            FLAGS["default_user_output_tokens_per_second_ceiling"],
            "300",
            FLAGS["user_output_tokens_per_second_ceiling"],
            '{"a": 400, "b": null}',
        ]
    )
    config = config_from_args(args)
    assert config.default_ceiling == 300
    assert config.user_ceilings == {"a": 400, "b": None}
    assert OutputRateConfig.from_dict(config.to_dict()) == config
    # A ceiling alone turns nothing on.
    ceiling_only = parser().parse_args(
        [FLAGS["default_user_output_tokens_per_second_ceiling"], "5"]
    )
    assert not config_from_args(ceiling_only).enabled
