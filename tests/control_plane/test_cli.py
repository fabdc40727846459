"""`output-rate` itself: --version, the startup summary, migrations found through the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from sqlalchemy import create_engine, inspect

from control_plane import __version__
from control_plane.cli import connection_summary, main, safe_database_url, startup_summary
from control_plane.models import Base
from control_plane.settings import Settings


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"output-rate {__version__}"
    assert __version__[0].isdigit() and __version__ != "0+unknown"


def test_summary_masks_the_password_and_says_what_is_on() -> None:
    public, secret = zmq.curve_keypair()
    settings = Settings(
        database_url="postgresql+psycopg://limits:s3cr3t@db.internal:5432/limits",
        zmq_secret_key=secret.decode(),  # type: ignore[arg-type]
        zmq_public_key=public.decode(),
        _env_file=None,  # type: ignore[call-arg]
    )
    text = startup_summary(settings, "0.0.0.0", 8800, "tcp://0.0.0.0:5557", auth=True)
    assert "s3cr3t" not in text
    assert "database: postgresql+psycopg://limits:***@db.internal:5432/limits" in text
    assert "http://0.0.0.0:8800/" in text
    assert "auth:     on" in text
    assert "push:     tcp://0.0.0.0:5557, CURVE on" in text

    plain = Settings(database_url="sqlite:///./x.db", _env_file=None)  # type: ignore[call-arg]
    text = startup_summary(plain, "::1", 8700, "tcp://127.0.0.1:5557", auth=False)
    assert "http://[::1]:8700/" in text
    assert "auth:     OFF" in text
    assert "CURVE OFF" in text


def test_summary_says_the_connection_bounds_and_the_open_file_limit() -> None:
    from control_plane.http_server import OpenFileLimit, guarded_protocol, http_limits

    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    protocol = guarded_protocol(http_limits(settings, 1024))
    text = connection_summary(settings, protocol, OpenFileLimit(1024, 1024))
    assert "at most 672 connections (then 503, over 768 closed unread)" in text
    assert "head 10 s and 65536 bytes, idle 10 s, keep-alive 5 s (httptools)" in text
    assert text.endswith("files:    open-file limit 1024")
    raised = connection_summary(settings, protocol, OpenFileLimit(524288, 1024))
    assert raised.endswith("open-file limit 524288 (raised from 1024)")


def test_passwords_are_never_shown() -> None:
    assert safe_database_url("not a url s3cr3t") == "<unparsable URL>"
    shown = safe_database_url("postgresql+psycopg://u@db/x?Password=s3cr3t&sslmode=require")
    assert "s3cr3t" not in shown
    assert shown.startswith("postgresql+psycopg://u@db/x?Password=")
    assert shown.endswith("&sslmode=require")
    assert safe_database_url("sqlite:///./output_rate.db") == "sqlite:///./output_rate.db"


def test_db_upgrade_from_any_folder_needs_no_checkout_files(tmp_path: Path) -> None:
    # The working folder has no alembic.ini or migrations/: both come with the package.
    url = f"sqlite:///{tmp_path / 'any.db'}"
    env = {"OUTPUT_RATE_DATABASE_URL": url, "PATH": "/usr/bin:/bin"}
    code = "import sys; from control_plane.cli import main; sys.exit(main(['db', 'upgrade']))"
    root = str(Path(__file__).resolve().parents[2])
    subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": root},
        check=True,
        timeout=120,
    )
    engine = create_engine(url)
    try:
        assert set(inspect(engine).get_table_names()) - {"alembic_version"} == set(
            Base.metadata.tables
        )
    finally:
        engine.dispose()
