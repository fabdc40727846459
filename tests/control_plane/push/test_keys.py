"""`output-rate keys`: CURVE key pairs for the push endpoint and its engines."""

from __future__ import annotations

import argparse
import shlex
import stat
from pathlib import Path

import pytest
import zmq

from control_plane.cli import main
from control_plane.push import keys
from control_plane.settings import Settings
from engine_ext.flags import add_flags, config_from_args
from output_rate_core.zmq_util import ENGINE_SECRET_KEY_ENV


def test_keys_written_for_the_control_plane_and_each_engine(tmp_path: Path) -> None:
    out = tmp_path / "keys"
    assert main(["keys", "--out", str(out), "--engines", "2"]) == 0
    files = sorted(f.name for f in out.iterdir())
    assert files == ["control-plane.env", "engine-1.env", "engine-2.env"]
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    settings = Settings(_env_file=out / "control-plane.env")  # type: ignore[call-arg]
    assert settings.zmq_secret_key is not None
    server_secret = settings.zmq_secret_key.get_secret_value()
    assert zmq.curve_public(server_secret.encode()).decode() == settings.zmq_public_key
    engine_secrets = [
        (out / f"engine-{i}.env").read_text().strip().split("=", 1)[1].strip("'") for i in (1, 2)
    ]
    # Each engine key may claim only its own engine id.
    assert settings.allowed_engine_keys() == {
        zmq.curve_public(secret.encode()).decode(): frozenset({f"engine-{i}"})
        for i, secret in enumerate(engine_secrets, 1)
    }
    assert (out / "engine-1.env").read_text().startswith(ENGINE_SECRET_KEY_ENV + "=")
    # Never overwritten: the old keys would be lost (before: silently replaced).
    old = {f.name: f.read_text() for f in out.iterdir()}
    assert main(["keys", "--out", str(out), "--engines", "2"]) == 2
    assert {f.name: f.read_text() for f in out.iterdir()} == old
    assert main(["keys", "--out", str(out), "--engines", "2", "--force"]) == 0
    assert (out / "engine-1.env").read_text() != old["engine-1.env"]


def test_keys_printed() -> None:
    text = keys.run(out_dir=None, num_engines=1)
    assert "OUTPUT_RATE_ZMQ_SECRET_KEY=" in text and ENGINE_SECRET_KEY_ENV in text
    assert "--control-plane-public-key='" in text


def test_the_printed_flag_parses_also_for_a_key_that_begins_with_a_dash() -> None:
    """About one key in 85 begins with '-': `--control-plane-public-key KEY` is then
    refused by the engine's parser ("expected one argument"), the printed form is not."""
    public = next(
        k for k in (zmq.curve_keypair()[0].decode() for _ in range(100_000)) if k[0] == "-"
    )
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser)
    with pytest.raises(argparse.ArgumentError, match="expected one argument"):
        parser.parse_args(["--control-plane-public-key", public])
    args = parser.parse_args(shlex.split(keys.public_key_flag(public)))
    assert config_from_args(args).control_plane_public_key == public
