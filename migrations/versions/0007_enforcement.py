"""shadow limits: a nullable enforcement on users and tiers and a default one on the
config row; would-throttle counts in the usage history

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# table -> its enforcement column (null: inherit)
ENFORCEMENT_COLUMNS = {
    "user_limits": "enforcement",
    "tiers": "enforcement",
    "config_state": "default_enforcement",
}


def _check_name(table: str, column: str) -> str:
    return f"ck_{table}_{column}_valid"


def upgrade() -> None:
    for table, column in ENFORCEMENT_COLUMNS.items():
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column(column, sa.String(length=7), nullable=True))
            batch_op.create_check_constraint(
                op.f(_check_name(table, column)),
                f"{column} IS NULL OR {column} IN ('enforce', 'shadow')",
            )
    with op.batch_alter_table("usage_minutes", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("would_throttle", sa.BigInteger(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("usage_minutes", schema=None) as batch_op:
        batch_op.drop_column("would_throttle")
    for table, column in ENFORCEMENT_COLUMNS.items():
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(op.f(_check_name(table, column)), type_="check")
            batch_op.drop_column(column)
