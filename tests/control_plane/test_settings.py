"""Settings come from OUTPUT_RATE_* variables or a .env file; the environment wins."""

from __future__ import annotations

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
