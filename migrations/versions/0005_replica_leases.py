"""replica leases: which replica runs the fleet-wide work, with a fencing token

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# The leases that exist; their row is made here so that taking one is always an UPDATE
# of a locked row (two replicas cannot both insert it).
LEASES = ("leader",)


def upgrade() -> None:
    leases = op.create_table(
        "replica_leases",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("holder", sa.String(length=128), nullable=False),
        sa.Column("token", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_replica_leases")),
    )
    never = datetime(1970, 1, 1, tzinfo=UTC)
    op.bulk_insert(
        leases, [{"name": n, "holder": "", "token": 0, "expires_at": never} for n in LEASES]
    )


def downgrade() -> None:
    op.drop_table("replica_leases")
