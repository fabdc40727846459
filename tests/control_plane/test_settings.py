"""Settings come from OUTPUT_RATE_* variables or a .env file; the environment wins."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from control_plane.settings import Settings


def test_defaults_env_and_dotenv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("DATABASE_URL", "HOST", "PORT", "ZMQ_ENDPOINT", "ADMIN_TOKEN"):
        monkeypatch.delenv(f"OUTPUT_RATE_{name}", raising=False)
    defaults = Settings()
    assert (defaults.database_url, defaults.host, defaults.port) == (
        "sqlite:///./output_rate.db",
        "127.0.0.1",
        8700,
    )
    assert defaults.zmq_endpoint == "tcp://127.0.0.1:5557"
    assert defaults.admin_token is None
    (tmp_path / ".env").write_text("OUTPUT_RATE_PORT=9100\nOUTPUT_RATE_ADMIN_TOKEN=from-dotenv\n")
    monkeypatch.setenv("OUTPUT_RATE_PORT", "9200")
    settings = Settings()
    assert settings.port == 9200
    assert settings.admin_token is not None
    assert settings.admin_token.get_secret_value() == "from-dotenv"
    assert "from-dotenv" not in repr(settings)


def _keys() -> tuple[str, str]:
    import zmq

    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def _bad_settings() -> list[tuple[dict[str, str], str]]:
    server_public, server_secret = _keys()
    engine_public, _ = _keys()
    other_public, _ = _keys()
    curve = {"OUTPUT_RATE_ZMQ_SECRET_KEY": server_secret}
    keys = "OUTPUT_RATE_ZMQ_CLIENT_KEYS"
    history = "OUTPUT_RATE_USAGE_HISTORY_MAX_USERS_PER_MINUTE"
    policy = "OUTPUT_RATE_OUTAGE_POLICY"
    keep_s = "OUTPUT_RATE_OUTAGE_KEEP_S"
    fraction = "OUTPUT_RATE_OUTAGE_FRACTION"
    return [
        ({**curve, keys: f"'{engine_public}'"}, keys),
        ({**curve, keys: f"{engine_public} {other_public}"}, keys),
        ({**curve, keys: engine_public[:-1]}, keys),
        ({**curve, keys: engine_public[:-1] + "~"}, keys),
        ({**curve, keys: f"{engine_public}=engine one"}, keys),
        ({**curve, keys: f"{engine_public},,{other_public}"}, keys),
        ({keys: engine_public}, keys),  # no CURVE: no key is ever checked
        ({"OUTPUT_RATE_ENGINE_TIMEOUT_S": "1.0"}, "OUTPUT_RATE_ENGINE_TIMEOUT_S"),
        ({"OUTPUT_RATE_ENGINE_TIMEOUT_S": "0.5"}, "OUTPUT_RATE_ENGINE_TIMEOUT_S"),
        ({"OUTPUT_RATE_PORT": "99999"}, "OUTPUT_RATE_PORT"),
        ({"OUTPUT_RATE_PORT": "0"}, "OUTPUT_RATE_PORT"),
        ({"OUTPUT_RATE_ZMQ_SECRET_KEY": "not-a-key"}, "OUTPUT_RATE_ZMQ_SECRET_KEY"),
        ({"OUTPUT_RATE_ZMQ_SECRET_KEY": server_secret[:-1] + "~"}, "OUTPUT_RATE_ZMQ_SECRET_KEY"),
        ({**curve, "OUTPUT_RATE_ZMQ_PUBLIC_KEY": other_public}, "OUTPUT_RATE_ZMQ_PUBLIC_KEY"),
        ({"OUTPUT_RATE_ZMQ_PUBLIC_KEY": server_public}, "OUTPUT_RATE_ZMQ_PUBLIC_KEY"),
        ({"OUTPUT_RATE_ADMIN_TOKEN": ""}, "OUTPUT_RATE_ADMIN_TOKEN"),
        ({"OUTPUT_RATE_ADMIN_TOKEN": "   "}, "OUTPUT_RATE_ADMIN_TOKEN"),
        ({"OUTPUT_RATE_ADMIN_TOKEN": " admin-secret-token "}, "OUTPUT_RATE_ADMIN_TOKEN"),
        ({"OUTPUT_RATE_ADMIN_TOKEN": "x"}, "OUTPUT_RATE_ADMIN_TOKEN"),
        ({"OUTPUT_RATE_ENGINE_RETENTION_S": "2"}, "OUTPUT_RATE_ENGINE_RETENTION_S"),
        ({"OUTPUT_RATE_MAX_KEYS_PER_USER": "0"}, "OUTPUT_RATE_MAX_KEYS_PER_USER"),
        ({"OUTPUT_RATE_MAX_KEYS_PER_USER": "many"}, "OUTPUT_RATE_MAX_KEYS_PER_USER"),
        ({"OUTPUT_RATE_KEY_CREATIONS_PER_MINUTE": "0"}, "OUTPUT_RATE_KEY_CREATIONS_PER_MINUTE"),
        ({"OUTPUT_RATE_KEY_CREATION_BURST": "1.5"}, "OUTPUT_RATE_KEY_CREATION_BURST"),
        ({"OUTPUT_RATE_KEY_CREATION_BURST": "-1"}, "OUTPUT_RATE_KEY_CREATION_BURST"),
        *(({history: value}, history) for value in ("0", "100001", "lots", "2.5")),
        ({"OUTPUT_RATE_HTTP_HEADER_TIMEOUT_S": "0"}, "OUTPUT_RATE_HTTP_HEADER_TIMEOUT_S"),
        ({"OUTPUT_RATE_HTTP_HEADER_TIMEOUT_S": "nan"}, "OUTPUT_RATE_HTTP_HEADER_TIMEOUT_S"),
        ({"OUTPUT_RATE_HTTP_MAX_HEADER_BYTES": "1023"}, "OUTPUT_RATE_HTTP_MAX_HEADER_BYTES"),
        ({"OUTPUT_RATE_HTTP_MAX_HEADER_BYTES": "64k"}, "OUTPUT_RATE_HTTP_MAX_HEADER_BYTES"),
        ({"OUTPUT_RATE_HTTP_IDLE_TIMEOUT_S": "-1"}, "OUTPUT_RATE_HTTP_IDLE_TIMEOUT_S"),
        ({"OUTPUT_RATE_HTTP_IDLE_TIMEOUT_S": "301"}, "OUTPUT_RATE_HTTP_IDLE_TIMEOUT_S"),
        ({"OUTPUT_RATE_HTTP_KEEP_ALIVE_TIMEOUT_S": "0"}, "OUTPUT_RATE_HTTP_KEEP_ALIVE_TIMEOUT_S"),
        ({"OUTPUT_RATE_HTTP_KEEP_ALIVE_TIMEOUT_S": "1.5"}, "OUTPUT_RATE_HTTP_KEEP_ALIVE_TIMEOUT_S"),
        ({"OUTPUT_RATE_HTTP_MAX_CONNECTIONS": "0"}, "OUTPUT_RATE_HTTP_MAX_CONNECTIONS"),
        # The timeouts against each other: gone_after under 2 x lease + 1 s.
        ({"OUTPUT_RATE_SHARE_GONE_AFTER_S": "10"}, "OUTPUT_RATE_SHARE_GONE_AFTER_S"),
        (
            {"OUTPUT_RATE_SHARE_LEASE_S": "5", "OUTPUT_RATE_SHARE_GONE_AFTER_S": "10.9"},
            "OUTPUT_RATE_SHARE_GONE_AFTER_S",
        ),
        # The outage policy: a known one, with its own setting and no other's.
        ({policy: "drop"}, policy),
        ({policy: "keep"}, policy),  # no keep time
        ({policy: "fraction"}, policy),  # no fraction: the operator picks the trade
        ({keep_s: "30"}, keep_s),  # set, but the policy is "serving"
        ({fraction: "0.25"}, fraction),
        ({policy: "fraction", fraction: "0.25", keep_s: "30"}, keep_s),
        ({policy: "keep", keep_s: "0.5"}, keep_s),
        ({policy: "keep", keep_s: "3601"}, keep_s),
        ({policy: "keep", keep_s: "nan"}, keep_s),
        *(({policy: "fraction", fraction: v}, fraction) for v in ("0", "1.5", "nan", "a quarter")),
        # Kept shares grow the least gone_after: 2 x 10 + 30 + 1 = 51 s.
        (
            {policy: "keep", keep_s: "30", "OUTPUT_RATE_SHARE_GONE_AFTER_S": "50"},
            "OUTPUT_RATE_SHARE_GONE_AFTER_S",
        ),
        # More than any open-file limit leaves: refused at start, before the database.
        ({"OUTPUT_RATE_HTTP_MAX_CONNECTIONS": str(10**9)}, "OUTPUT_RATE_HTTP_MAX_CONNECTIONS"),
    ]


def test_each_bad_setting_stops_serve_naming_its_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from control_plane.cli import main

    monkeypatch.chdir(tmp_path)
    for env, name in _bad_settings():
        with monkeypatch.context() as m:
            m.setenv("OUTPUT_RATE_DATABASE_URL", f"sqlite:///{tmp_path / 'never.db'}")
            m.setenv("OUTPUT_RATE_ADMIN_TOKEN", "admin-secret-token")
            for key, value in env.items():
                m.setenv(key, value)
            assert main(["serve"]) == 2, env
        err = capsys.readouterr().err
        assert f"error: {name}" in err, (env, err)
    assert not (tmp_path / "never.db").exists()  # refused before anything was touched


def test_cli_port_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from control_plane.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--port", "99999"])
    assert exit_.value.code == 2 and "--port" in capsys.readouterr().err


def test_good_curve_settings_and_a_short_token_warning(caplog: pytest.LogCaptureFixture) -> None:
    # The warning's level, whatever an earlier test left on the root logger
    # (tests/engine_ext/test_identity_server.py, which builds vLLM's app in-process, leaves
    # it at ERROR).
    caplog.set_level(logging.WARNING, logger="control_plane")
    server_public, server_secret = _keys()
    one, _ = _keys()
    two, _ = _keys()
    settings = Settings(
        admin_token="short-token",  # type: ignore[arg-type]
        zmq_secret_key=server_secret,  # type: ignore[arg-type]
        zmq_public_key=server_public,
        zmq_client_keys=f" {one}=engine-1|engine-1b, {two} ",
    )
    assert settings.allowed_engine_keys() == {one: frozenset({"engine-1", "engine-1b"}), two: None}
    assert "OUTPUT_RATE_ADMIN_TOKEN is only 11 characters" in caplog.text


def test_a_bad_setting_exits_the_real_process_with_status_2(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "OUTPUT_RATE_DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}",
        "OUTPUT_RATE_ADMIN_TOKEN": "admin-secret-token",
        "OUTPUT_RATE_ENGINE_TIMEOUT_S": "1",
    }
    run = subprocess.run(
        [sys.executable, "-m", "control_plane.cli", "serve"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "error: OUTPUT_RATE_ENGINE_TIMEOUT_S" in run.stderr
    assert "Traceback" not in run.stderr


def test_timeouts_at_their_least_pass_and_a_lease_under_the_failover_is_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from control_plane.fleet.allocator import min_gone_after_s

    at_least = Settings(
        share_lease_s=6, share_gone_after_s=min_gone_after_s(6), engine_timeout_s=13
    )
    assert at_least.share_gone_after_s == 13.0
    assert "OUTPUT_RATE_SHARE_LEASE_S" not in caplog.text
    Settings(share_lease_s=2)
    assert "OUTPUT_RATE_SHARE_LEASE_S=2.0 is under" in caplog.text
    # An engine timeout over gone_after (3 x the lease when unset) only counts dropped
    # engines a while longer: said, not refused.
    Settings(engine_timeout_s=31)
    assert "OUTPUT_RATE_ENGINE_TIMEOUT_S=31.0 is over OUTPUT_RATE_SHARE_GONE_AFTER_S" in caplog.text


def test_the_outage_policy_and_its_setting_reach_the_allocator() -> None:
    from control_plane.app import _new_fleet
    from control_plane.fleet.allocator import min_gone_after_s
    from output_rate_core.outage import OutagePolicy

    assert Settings().outage == OutagePolicy("serving")
    keep = Settings(outage_policy="keep", outage_keep_s=30)
    assert keep.outage == OutagePolicy("keep", keep_s=30.0)
    # Unset, gone_after is 3 x the lease but at least 2 x lease + keep + 1 s.
    assert _new_fleet(keep)._allocator._gone_after_s == min_gone_after_s(10.0, 30.0) == 51.0
    Settings(outage_policy="keep", outage_keep_s=30, share_gone_after_s=51)
    fraction = Settings(outage_policy="fraction", outage_fraction=0.25)
    assert fraction.outage == OutagePolicy("fraction", fraction=0.25)
    assert _new_fleet(fraction)._allocator.outage == fraction.outage
