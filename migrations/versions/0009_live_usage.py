"""live usage and fleet shares shared by replicas; API servers homed at one replica

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "live_usage",
        sa.Column("replica", sa.String(length=128), nullable=False),
        sa.Column("engine_id", sa.String(length=256), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("replica", "engine_id", name=op.f("pk_live_usage")),
    )
    op.create_index("ix_live_usage_updated_at", "live_usage", ["updated_at"])
    op.create_table(
        "fleet_shares",
        sa.Column("token", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("holder", sa.String(length=128), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("token", name=op.f("pk_fleet_shares")),
    )
    with op.batch_alter_table("engines") as batch:
        batch.add_column(sa.Column("api_home_replica", sa.String(length=128), nullable=True))
        batch.add_column(sa.Column("api_home_seen_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("engines") as batch:
        batch.drop_column("api_home_seen_at")
        batch.drop_column("api_home_replica")
    op.drop_table("fleet_shares")
    op.drop_index("ix_live_usage_updated_at", table_name="live_usage")
    op.drop_table("live_usage")
