"""`output-rate`: serve the control plane, migrate its database, make CURVE keys."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from alembic.config import Config
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

import control_plane.migrations
from control_plane import __version__
from control_plane.settings import Settings, settings_errors

if TYPE_CHECKING:
    from control_plane.http_server import GuardedProtocol, OpenFileLimit

# The checkout's migrations/ folder, installed as this subpackage (setup.py maps it), so
# an installed control plane finds it in any folder; the checkout's alembic.ini points there.
MIGRATIONS_DIR = Path(control_plane.migrations.__file__).resolve().parent
logger = logging.getLogger("control_plane")


def alembic_config(database_url: str) -> Config:
    """Alembic's configuration, from the package alone (no alembic.ini needed)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("path_separator", "os")
    config.attributes["database_url"] = database_url
    return config


# PostgreSQL advisory lock key held while migrating: replicas starting at once migrate
# one after the other (the later ones find the schema at head and do nothing).
MIGRATION_LOCK_KEY = 0x6F75747075745F72  # "output_r"


def upgrade(database_url: str, revision: str = "head") -> None:
    from alembic import command
    from sqlalchemy import create_engine, text

    if make_url(database_url).get_backend_name() != "postgresql":
        command.upgrade(alembic_config(database_url), revision)
        return
    engine = create_engine(database_url)
    try:
        with engine.connect() as lock:
            lock.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            try:
                command.upgrade(alembic_config(database_url), revision)
            finally:
                lock.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY})
    finally:
        engine.dispose()


def downgrade(database_url: str, revision: str) -> None:
    from alembic import command

    command.downgrade(alembic_config(database_url), revision)


def serve(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    from control_plane.app import create_served_app
    from control_plane.errors import ConfigurationError
    from control_plane.http_server import guarded_protocol, http_limits, raise_open_file_limit
    from control_plane.replicas.single import AnotherReplica

    if settings.admin_token is None and not args.insecure_no_auth:
        print(
            "error: OUTPUT_RATE_ADMIN_TOKEN is not set. Set it, or start with "
            "--insecure-no-auth to run without authentication (never in production).",
            file=sys.stderr,
        )
        return 2
    host = settings.host if args.host is None else args.host
    port = settings.port if args.port is None else args.port
    files = raise_open_file_limit()
    try:
        limits = http_limits(settings, files.num_files)
        protocol = guarded_protocol(limits)
    except ConfigurationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    upgrade(settings.database_url)
    # create_app logs the loud warning when authentication is off.
    served = create_served_app(settings, insecure_no_auth=args.insecure_no_auth)
    # The live push endpoint (control_plane/push) runs beside the API and stops with it.
    try:
        served.start()
    except AnotherReplica as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        # Opened now, on the thread that runs the event loop: no request or usage flush
        # has to open a database connection (a file) while serving.
        served.db.open_connections()
        print(
            startup_summary(
                settings, host, port, served.push.endpoint, auth=not args.insecure_no_auth
            )
            + "\n"
            + connection_summary(settings, protocol, files),
            file=sys.stderr,
            flush=True,
        )
        uvicorn.run(
            served.app,
            host=host,
            port=port,
            http=protocol,
            # The API has no WebSocket route: no upgrade to another protocol's timeouts.
            ws="none",
            timeout_keep_alive=settings.http_keep_alive_timeout_s,
            log_level="info",
            # One line per request costs a third of a small request's time; opt in.
            access_log=args.access_log,
        )
    finally:
        served.close()
    return 0


def safe_database_url(url: str) -> str:
    """The database URL as it may be shown: the password masked (also as a query option)."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return "<unparsable URL>"
    query = {k: "***" if "password" in k.lower() else v for k, v in parsed.query.items()}
    return parsed.set(query=query).render_as_string(hide_password=True)


def startup_summary(
    settings: Settings, host: str, port: int, push_endpoint: str, *, auth: bool
) -> str:
    """What `output-rate serve` tells the operator before it starts listening."""
    from control_plane.app import UI_DIR

    http_host = f"[{host}]" if ":" in host else host
    ui = "UI at /ui/" if (UI_DIR / "index.html").is_file() else "no UI built"
    lines = [
        f"output-rate {__version__}",
        f"  API:      http://{http_host}:{port}/ ({ui}, OpenAPI at /docs)",
        f"  database: {safe_database_url(settings.database_url)}",
        "  auth:     " + ("on (admin token)" if auth else "OFF (--insecure-no-auth)"),
        f"  push:     {push_endpoint}, CURVE "
        + ("on" if settings.zmq_secret_key is not None else "OFF (plain TCP)"),
    ]
    return "\n".join(lines)


def connection_summary(
    settings: Settings, protocol: type[GuardedProtocol], files: OpenFileLimit
) -> str:
    """The summary's lines on HTTP connections and open files (docs/deploy.md)."""
    limits = protocol.limits
    raised = (
        f" (raised from {files.num_files_before})"
        if files.num_files != files.num_files_before
        else ""
    )
    return "\n".join(
        [
            f"  http:     at most {limits.max_connections} connections (then 503, over "
            f"{limits.max_open} closed unread); head {limits.header_timeout_s:g} s and "
            f"{limits.max_head_bytes} bytes, idle "
            f"{limits.idle_timeout_s:g} s, keep-alive {settings.http_keep_alive_timeout_s} s "
            f"({protocol.parser})",
            f"  files:    open-file limit {files.num_files}{raised}",
        ]
    )


def keys(args: argparse.Namespace) -> int:
    from control_plane.push.keys import KeysExist, run

    try:
        print(run(out_dir=args.out, num_engines=args.engines, force=args.force), end="")
    except KeysExist as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port 1..65535, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port 1..65535, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(prog="output-rate", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="migrate to head, then serve API, UI, ZMQ")
    serve_parser.add_argument("--host", default=None)
    serve_parser.add_argument("--port", type=port, default=None)
    serve_parser.add_argument(
        "--insecure-no-auth", action="store_true", help="serve without authentication (unsafe)"
    )
    serve_parser.add_argument("--access-log", action="store_true", help="log every request")
    db_parser = commands.add_parser("db", help="database migrations")
    db_commands = db_parser.add_subparsers(dest="db_command", required=True)
    db_commands.add_parser("upgrade", help="upgrade to the latest schema")
    down = db_commands.add_parser("downgrade", help="downgrade to a revision")
    down.add_argument("revision")
    keys_parser = commands.add_parser(
        "keys",
        help="make CURVE key pairs for the push endpoint and its engines",
        description="Make CURVE key pairs: the push endpoint's and one per engine. Replicas "
        "of one control plane share one server identity: copy the same control-plane.env "
        "(OUTPUT_RATE_ZMQ_SECRET_KEY and OUTPUT_RATE_ZMQ_CLIENT_KEYS) to every replica; "
        "engines keep one --control-plane-public-key and list the replicas in "
        "--control-plane-endpoint tcp://cp-a:5557,tcp://cp-b:5557.",
    )
    keys_parser.add_argument(
        "--out", type=Path, default=None, help="write <out>/control-plane.env, engine-N.env"
    )
    keys_parser.add_argument("--engines", type=int, default=1, help="engine key pairs to make")
    keys_parser.add_argument(
        "--force", action="store_true", help="replace existing key files under --out"
    )
    args = parser.parse_args(argv)
    if args.command == "keys":
        return keys(args)

    try:
        settings = Settings()
    except ValueError as e:  # pydantic's ValidationError: one line per bad variable
        for line in settings_errors(e):
            print(f"error: {line}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return serve(args, settings)
    if args.command == "db":
        if args.db_command == "upgrade":
            upgrade(settings.database_url)
        else:
            downgrade(settings.database_url, args.revision)
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
