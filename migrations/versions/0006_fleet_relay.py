"""fleet relay: engines' fleet frames between replicas; engines' home replica

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fleet_relay",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(),
            nullable=False,
        ),
        sa.Column("kind", sa.String(length=4), nullable=False),
        sa.Column("token", sa.BigInteger(), nullable=False),
        sa.Column("from_replica", sa.String(length=128), nullable=False),
        sa.Column("to_replica", sa.String(length=128), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("kind IN ('up', 'down')", name=op.f("ck_fleet_relay_kind_valid")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fleet_relay")),
    )
    op.create_index("ix_fleet_relay_kind_to_replica", "fleet_relay", ["kind", "to_replica"])
    op.create_index("ix_fleet_relay_created_at", "fleet_relay", ["created_at"])
    with op.batch_alter_table("engines") as batch:
        batch.add_column(sa.Column("home_replica", sa.String(length=128), nullable=True))
        batch.add_column(sa.Column("home_seen_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("engines") as batch:
        batch.drop_column("home_seen_at")
        batch.drop_column("home_replica")
    op.drop_index("ix_fleet_relay_created_at", table_name="fleet_relay")
    op.drop_index("ix_fleet_relay_kind_to_replica", table_name="fleet_relay")
    op.drop_table("fleet_relay")
