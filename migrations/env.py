"""Alembic environment: the only way the schema is made."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from control_plane.models import Base
from control_plane.settings import Settings

config = context.config
target_metadata = Base.metadata


def database_url() -> str:
    # A caller (the CLI, tests) may pass the URL; otherwise the settings decide.
    return config.attributes.get("database_url") or Settings().database_url


def run_migrations_offline() -> None:
    context.configure(url=database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    url = database_url()
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=url.startswith("sqlite"),
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
