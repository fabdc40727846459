"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-12-01
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=272), nullable=False),
        sa.Column("before", sa.JSON(), nullable=True),
        sa.Column("after", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_log_at"), ["at"], unique=False)

    op.create_table(
        "config_changes",
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ops", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("version", name=op.f("pk_config_changes")),
    )
    op.create_table(
        "config_state",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("default_rate", sa.Integer(), nullable=True),
        sa.Column("num_users", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "default_rate IS NULL OR (default_rate >= 1 AND default_rate <= 1000000)",
            name=op.f("ck_config_state_default_rate_range"),
        ),
        sa.CheckConstraint("id = 1", name=op.f("ck_config_state_single_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_config_state")),
    )
    op.create_table(
        "engines",
        sa.Column("engine_id", sa.String(length=256), nullable=False),
        sa.Column("model", sa.String(length=512), nullable=False),
        sa.Column("applied_version", sa.Integer(), nullable=False),
        sa.Column("connected", sa.Boolean(), nullable=False),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("engine_id", name=op.f("pk_engines")),
    )
    op.create_table(
        "tiers",
        sa.Column(
            "name",
            sa.String(length=64).with_variant(sa.String(length=64, collation="C"), "postgresql"),
            nullable=False,
        ),
        sa.Column("rate", sa.Integer(), nullable=True),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("num_users", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "rate IS NULL OR (rate >= 1 AND rate <= 1000000)", name=op.f("ck_tiers_rate_range")
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_tiers")),
    )
    op.create_table(
        "viewer_tokens",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_viewer_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_viewer_tokens_token_hash")),
    )
    op.create_table(
        "user_limits",
        sa.Column(
            "user",
            sa.String(length=256).with_variant(sa.String(length=256, collation="C"), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "tier",
            sa.String(length=64).with_variant(sa.String(length=64, collation="C"), "postgresql"),
            nullable=True,
        ),
        sa.Column("rate", sa.Integer(), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "rate IS NULL OR (rate >= 1 AND rate <= 1000000)",
            name=op.f("ck_user_limits_rate_range"),
        ),
        sa.ForeignKeyConstraint(["tier"], ["tiers.name"], name=op.f("fk_user_limits_tier_tiers")),
        sa.PrimaryKeyConstraint("user", name=op.f("pk_user_limits")),
    )
    with op.batch_alter_table("user_limits", schema=None) as batch_op:
        batch_op.create_index("ix_user_limits_tier_user", ["tier", "user"], unique=False)

    # The single config row: version 0, no default limit, no users.
    config_state = sa.table(
        "config_state",
        sa.column("id", sa.Integer),
        sa.column("version", sa.Integer),
        sa.column("default_rate", sa.Integer),
        sa.column("num_users", sa.BigInteger),
        sa.column("updated_at", sa.DateTime(timezone=True)),
    )
    op.bulk_insert(
        config_state,
        [
            {
                "id": 1,
                "version": 0,
                "default_rate": None,
                "num_users": 0,
                "updated_at": datetime.now(UTC),
            }
        ],
    )


def downgrade() -> None:
    with op.batch_alter_table("user_limits", schema=None) as batch_op:
        batch_op.drop_index("ix_user_limits_tier_user")

    op.drop_table("user_limits")
    op.drop_table("viewer_tokens")
    op.drop_table("tiers")
    op.drop_table("engines")
    op.drop_table("config_state")
    op.drop_table("config_changes")
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_log_at"))

    op.drop_table("audit_log")
