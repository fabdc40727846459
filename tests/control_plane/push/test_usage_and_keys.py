"""Usage aggregation (with a fake clock: the one seam) and `output-rate keys`."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import zmq

from control_plane.cli import main
from control_plane.push import keys
from control_plane.push.usage import UsageBook
from control_plane.settings import Settings
from output_rate_core import protocol as p
from output_rate_core.zmq_util import ENGINE_SECRET_KEY_ENV


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rates_are_summed_over_engines_and_windows_expire() -> None:
    clock = FakeClock()
    book = UsageBook(clock)
    for _ in range(10):  # engine e1: 20 tokens/s for 10 s, half its steps throttled
        clock.now += 1.0
        book.add(p.Usage("e1", 1.0, {"a": 20}, {"a": 20}))
    book.add(p.Usage("e2", 2.0, {"a": 10, "b": 4}, {}))  # engine e2: 5 tokens/s of a
    (a, b) = book.totals()
    assert (a.user, b.user) == ("a", "b")
    assert a.tokens_per_s_10s == pytest.approx(25.0)
    assert a.tokens_per_s_1s == pytest.approx(25.0)  # each engine's latest report
    assert b.tokens_per_s_10s == pytest.approx(2.0)
    assert a.throttled_fraction == pytest.approx(200 / (210 + 200))
    assert b.throttled_fraction == 0.0
    clock.now += 2.5  # the latest reports are no longer "the last second"
    (a, _) = book.totals()
    assert a.tokens_per_s_1s == 0.0 and a.tokens_per_s_10s > 0
    clock.now += 10.0
    assert book.totals() == []


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
    assert "--control-plane-public-key '" in text
