"""usage history: the tokens borrowed beyond the limit per user and minute (borrowed)

Rows written before this revision hold 0: nothing was reported as borrowed then (the
engines that borrow came with this revision's control plane, or reported no borrowing).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("usage_minutes", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("borrowed", sa.BigInteger(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("usage_minutes", schema=None) as batch_op:
        batch_op.drop_column("borrowed")
