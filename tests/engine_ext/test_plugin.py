"""The plugin on vLLM's real argument parser and EngineArgs (no server)."""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from engine_ext import vllm_compat
from engine_ext.config import CONFIG_KEY, OutputRateConfig
from engine_ext.identity import IDENTITY_ENV, MIDDLEWARE, OPERATOR_KEY_ENV, IdentityConfig
from engine_ext.plugin import (
    ASYNC_SCHEDULER,
    LIMITING_ENV,
    SYNC_SCHEDULER,
    limiting_on,
    register,
)
from engine_ext.verify import OutputRateConfigError
from harness.scheduler import TINY_MODEL

BASE = ["--model", str(TINY_MODEL), "--max-model-len", "512", "--enforce-eager"]


@pytest.fixture(autouse=True)
def _restore_limiting_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # from_cli_args marks the process (and its children) as limited; start
    # each test unmarked and let monkeypatch drop the mark afterwards.
    monkeypatch.setenv(LIMITING_ENV, "0")


def parse(*flags: str):
    register()
    register()  # idempotent: a second call must not add the flags twice
    parser = vllm_compat.make_arg_parser(FlexibleArgumentParser())
    return parser.parse_args([*BASE, *flags])


def engine_config(*flags: str):
    args = parse(*flags)
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


def test_no_flag_changes_nothing() -> None:
    config = engine_config()
    assert CONFIG_KEY not in config.additional_config
    assert "engine_ext" not in str(config.scheduler_config.scheduler_cls)
    assert not limiting_on()


def test_limit_flags_mark_the_process_tree_and_guard_beam_search() -> None:
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    engine_config("--default-user-output-tokens-per-second", "5")
    assert limiting_on()  # inherited by extra API server processes
    assert getattr(OpenAIServingCompletion.create_completion, "_output_rate_patched", False)


def test_flags_reach_the_engine_config_and_pick_the_sync_scheduler() -> None:
    config = engine_config(
        "--default-user-output-tokens-per-second",
        "50",
        "--user-output-tokens-per-second",
        '{"user-a": 20, "vip": null}',
        "--port",
        "8123",
        "--no-async-scheduling",
    )
    rate_config = OutputRateConfig.from_vllm_config(config)
    assert rate_config.default_rate == 50
    assert rate_config.user_rates == {"user-a": 20, "vip": None}
    assert rate_config.engine_id.endswith(":8123")
    assert config.scheduler_config.scheduler_cls == SYNC_SCHEDULER


def test_control_plane_replicas_reach_the_engine_config() -> None:
    config = engine_config("--control-plane-endpoint", "tcp://cp-a:5557,tcp://[::1]:5557")
    rate_config = OutputRateConfig.from_vllm_config(config)
    assert rate_config.control_plane_endpoints == ("tcp://cp-a:5557", "tcp://[::1]:5557")
    assert config.scheduler_config.scheduler_cls in (SYNC_SCHEDULER, ASYNC_SCHEDULER)


def test_scheduler_follows_the_resolved_async_scheduling() -> None:
    # vLLM's CPU platform turns async scheduling off after parsing; the choice
    # must follow the resolved value, not the flag.
    config = engine_config("--default-user-output-tokens-per-second", "5", "--async-scheduling")
    expected = ASYNC_SCHEDULER if config.scheduler_config.async_scheduling else SYNC_SCHEDULER
    assert config.scheduler_config.scheduler_cls == expected


def test_speculative_decoding_builds_a_limited_engine() -> None:
    config = engine_config(
        "--default-user-output-tokens-per-second",
        "5",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}',
    )
    assert config.speculative_config is not None
    assert config.speculative_config.num_speculative_tokens == 4
    assert config.scheduler_config.scheduler_cls in (SYNC_SCHEDULER, ASYNC_SCHEDULER)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--user-output-tokens-per-second", "{not json"], "not valid JSON"),
        (["--user-output-tokens-per-second", "[1, 2]"], "JSON object"),
        (["--user-output-tokens-per-second", '{"a": 0}'], "between 1 and 1000000"),
        (["--user-output-tokens-per-second", '{"a": 2.5}'], "integer"),
        (["--user-output-tokens-per-second", '{"a": 2000000}'], "between 1 and 1000000"),
        (["--user-output-tokens-per-second", '{"a": true}'], "integer"),
        (["--user-output-tokens-per-second", '{"a": "5"}'], "integer"),
        (["--user-output-tokens-per-second", '{"a": 5, "a": 6}'], "given twice"),
        (["--user-output-tokens-per-second", '{"": 5}'], "non-empty"),
        (["--user-output-tokens-per-second", '{"a\\u0001": 5}'], "control characters"),
        (["--default-user-output-tokens-per-second", "-3"], "between 1 and 1000000"),
        (["--default-user-output-tokens-per-second", "fast"], "integer"),
        (["--control-plane-endpoint", "http://x"], "ZMQ endpoint"),
        (["--control-plane-endpoint", "tcp://a:5557,tcp://b:5557,"], "empty entry"),
        (["--control-plane-endpoint", "tcp://a:5557,tcp://a:5557"], "twice"),
        (["--output-rate-metrics-users", "-1"], "integer 0..1000"),
        (["--output-rate-metrics-users", "1001"], "integer 0..1000"),
        (["--output-rate-metrics-users", "many"], "integer 0..1000"),
        (["--output-rate-metrics-idle-seconds", "0"], "seconds in (0, 86400]"),
        (["--output-rate-metrics-idle-seconds", "soon"], "seconds in (0, 86400]"),
        (["--output-rate-http-header-timeout", "0"], "seconds in (0, 300]"),
        (["--output-rate-http-idle-timeout", "301"], "seconds in (0, 300]"),
    ],
)
def test_bad_flag_values_fail_naming_the_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse(*flags)
    err = capsys.readouterr().err
    assert flags[0] in err
    assert message in err


@pytest.mark.parametrize(
    ("flags", "option"),
    [
        (["--scheduler-cls", "my.Scheduler"], "--scheduler-cls"),
        (["--data-parallel-size", "2"], "--data-parallel-size"),
        (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size"),
        (
            ["--kv-transfer-config", '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}'],
            "--kv-transfer-config",
        ),
    ],
)
def test_unsupported_modes_are_rejected_naming_the_option(flags: list[str], option: str) -> None:
    try:
        config = engine_config("--default-user-output-tokens-per-second", "10", *flags)
    except OutputRateConfigError as e:
        assert option in str(e)
        return
    except Exception as e:  # vLLM itself refused the mode on this machine first
        pytest.fail(f"vLLM rejected {flags} before the output-rate check: {e!r}")
    pytest.fail(f"accepted: {config}")


def test_metrics_flags_reach_the_engine_config() -> None:
    config = engine_config(
        "--default-user-output-tokens-per-second",
        "50",
        "--output-rate-metrics-users",
        "3",
        "--output-rate-metrics-idle-seconds",
        "5",
    )
    rate_config = OutputRateConfig.from_vllm_config(config)
    assert (rate_config.metrics_max_users, rate_config.metrics_idle_s) == (3, 5.0)


# ---- identity modes (docs/identity.md) ----------------------------------------------

CP = ["--control-plane-endpoint", "tcp://127.0.0.1:1"]
IDENTITY_MODES = {
    "header": ["--output-rate-identity", "header", "--output-rate-identity-header", "X-User"],
    "api-key": [*CP, "--output-rate-identity", "api-key"],
}


@pytest.fixture
def _identity_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # from_cli_args sets it for the API server processes; each test starts without it.
    monkeypatch.delenv(IDENTITY_ENV, raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv(OPERATOR_KEY_ENV, raising=False)


def from_cli_args(*flags: str) -> tuple[Any, AsyncEngineArgs]:
    args = parse(*flags)
    return args, AsyncEngineArgs.from_cli_args(args)


@pytest.mark.usefixtures("_identity_env")
def test_header_mode_adds_the_middleware_and_its_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args, _ = from_cli_args(
        "--default-user-output-tokens-per-second",
        "5",
        "--output-rate-identity",
        "header",
        "--output-rate-identity-header",
        "X-User",
        "--middleware",
        "some.Other",
    )
    assert args.middleware == ["some.Other", MIDDLEWARE]
    config = IdentityConfig.from_env()
    assert (config.mode, config.header, config.missing) == ("header", "X-User", "refuse")


@pytest.mark.usefixtures("_identity_env")
def test_api_key_mode_connects_as_the_engine_with_role_api() -> None:
    args, _ = from_cli_args(
        *CP, "--output-rate-engine-id", "eng-1", "--output-rate-identity", "api-key"
    )
    assert args.middleware == [MIDDLEWARE]
    config = IdentityConfig.from_env()
    assert (config.mode, config.engine_id, config.control_plane_endpoints) == (
        "api-key",
        "eng-1",
        (CP[1],),
    )
    assert config.model == str(TINY_MODEL)


@pytest.mark.usefixtures("_identity_env")
@pytest.mark.parametrize("mode", ["header", "api-key"])
def test_identity_modes_guard_the_servers_connections(mode: str) -> None:
    from vllm.entrypoints.launchers.api_server import entry

    from_cli_args(
        *IDENTITY_MODES[mode],
        "--default-user-output-tokens-per-second",
        "5",
        "--output-rate-http-header-timeout",
        "2.5",
    )
    config = IdentityConfig.from_env()
    assert (config.header_timeout_s, config.idle_timeout_s) == (2.5, 10.0)
    # The API server's uvicorn gets the guard as its protocol (engine_ext/http_server.py).
    assert getattr(entry.serve_http, vllm_compat.PATCHED_MARK, False)


@pytest.mark.usefixtures("_identity_env")
def test_the_operator_key_reaches_the_middleware_as_its_digest_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = "op-" + "x" * 40
    monkeypatch.setenv(OPERATOR_KEY_ENV, key)
    from_cli_args(*IDENTITY_MODES["api-key"])
    config = IdentityConfig.from_env()
    assert config.operator_key_sha256 == hashlib.sha256(key.encode()).hexdigest()
    assert key not in os.environ[IDENTITY_ENV]
    for bad in ("x" * 31, "with space " + "x" * 32, "é" * 40):
        monkeypatch.setenv(OPERATOR_KEY_ENV, bad)
        with pytest.raises(ValueError, match=f"{OPERATOR_KEY_ENV} must be at least 32"):
            from_cli_args(*IDENTITY_MODES["api-key"])
    # In header mode the gateway decides who reaches which route.
    monkeypatch.setenv(OPERATOR_KEY_ENV, key)
    with pytest.raises(ValueError, match=f"{OPERATOR_KEY_ENV} is only used with"):
        from_cli_args("--default-user-output-tokens-per-second", "5", *IDENTITY_MODES["header"])


@pytest.mark.usefixtures("_identity_env")
def test_body_mode_adds_nothing_and_says_identities_are_not_authenticated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.output_rate")
    args, _ = from_cli_args("--default-user-output-tokens-per-second", "5")
    assert MIDDLEWARE not in args.middleware
    assert IDENTITY_ENV not in os.environ
    assert sum("not authenticated" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.usefixtures("_identity_env")
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--output-rate-identity", "header"], "--output-rate-identity-header NAME"),
        (["--output-rate-identity-header", "X-User"], "only used with --output-rate-identity"),
        (["--output-rate-identity-missing", "anonymous"], "only used with"),
        (["--output-rate-identity", "api-key"], "needs --control-plane-endpoint"),
        ([*CP, "--output-rate-identity", "api-key", "--api-key", "k"], "--api-key"),
        ([*CP, "--output-rate-identity", "api-key", "--api-server-count", "2"], "count 1"),
        (["--output-rate-http-header-timeout", "3"], "only used with --output-rate-identity"),
    ],
)
def test_identity_flags_that_cannot_be_are_refused_naming_the_flag(
    flags: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match="--output-rate-identity") as e:
        from_cli_args("--default-user-output-tokens-per-second", "5", *flags)
    assert message in str(e.value)


@pytest.mark.usefixtures("_identity_env")
def test_identity_without_limits_and_vllm_api_key_env_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match="limits, which are off"):
        from_cli_args("--output-rate-identity", "header", "--output-rate-identity-header", "X")
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    with pytest.raises(ValueError, match="VLLM_API_KEY"):
        from_cli_args(*CP, "--output-rate-identity", "api-key")


# How a test gives each option of the release's frontends_without_middleware.
FRONTEND_FLAGS = {
    "--grpc": ["--grpc"],
    "--grpc-port": ["--grpc-port", "0"],
    "--headless": ["--headless"],
    "--headless-client-handshake-address": [
        "--headless",
        "--headless-client-handshake-address",
        "tcp://127.0.0.1:1",
    ],
}


@pytest.mark.usefixtures("_identity_env")
@pytest.mark.parametrize("mode", list(IDENTITY_MODES))
@pytest.mark.parametrize(
    "option", [option for option, _ in vllm_compat.release().frontends_without_middleware]
)
def test_identity_modes_refuse_every_frontend_without_the_middleware_naming_it(
    mode: str, option: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    flags = [*IDENTITY_MODES[mode], "--default-user-output-tokens-per-second", "5"]
    if option.startswith("--"):
        flags += FRONTEND_FLAGS[option]
    else:
        monkeypatch.setenv(option, "1")
    with pytest.raises(ValueError, match=f"--output-rate-identity {mode} cannot run with") as e:
        from_cli_args(*flags)
    assert f"{option}:" in str(e.value)
    assert IDENTITY_ENV not in os.environ
    # Without an identity mode nothing depends on the middleware: the frontend starts.
    monkeypatch.delenv(option, raising=False)
    from_cli_args("--default-user-output-tokens-per-second", "5", *FRONTEND_FLAGS.get(option, []))


def test_the_release_row_names_every_frontend_without_the_middleware() -> None:
    """The flags of the row are flags of this release's parser (a renamed one would
    silently stop being refused); the one environment variable is vLLM's."""
    import vllm.envs

    actions = {
        option
        for action in vllm_compat.make_arg_parser(FlexibleArgumentParser())._actions
        for option in action.option_strings
    }
    options = [option for option, _ in vllm_compat.release().frontends_without_middleware]
    assert {o for o in options if o.startswith("--")} <= actions
    assert [o for o in options if not o.startswith("--")] == ["VLLM_USE_RUST_FRONTEND"]
    assert "VLLM_USE_RUST_FRONTEND" in vllm.envs.environment_variables
    assert {"--grpc", "--grpc-port", "--headless"} <= set(options)


@pytest.mark.parametrize("name", ["X User", "X:User", "", "X-Üser"])
def test_a_header_name_must_be_an_http_token(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--output-rate-identity", "header", "--output-rate-identity-header", name)
    assert "HTTP header name" in capsys.readouterr().err
