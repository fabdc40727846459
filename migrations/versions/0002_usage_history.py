"""usage history: per-user per-minute rollups of reported usage

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_minutes",
        sa.Column(
            "user",
            sa.String(length=256).with_variant(sa.String(length=256, collation="C"), "postgresql"),
            nullable=False,
        ),
        sa.Column("minute", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("throttled", sa.BigInteger(), nullable=False),
        sa.Column("limit_rate", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("user", "minute", name=op.f("pk_usage_minutes")),
    )
    with op.batch_alter_table("usage_minutes", schema=None) as batch_op:
        batch_op.create_index("ix_usage_minutes_minute", ["minute"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("usage_minutes", schema=None) as batch_op:
        batch_op.drop_index("ix_usage_minutes_minute")
    op.drop_table("usage_minutes")
