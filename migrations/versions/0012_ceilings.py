"""borrowing: a nullable ceiling (tokens/s) on users and tiers and a default one on the
config row

Null on a user or a tier inherits; the default's null borrows nothing. Rows written
before this revision hold null: nobody borrows until a ceiling is set.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

# table -> its ceiling column
CEILING_COLUMNS = {
    "user_limits": "ceiling",
    "tiers": "ceiling",
    "config_state": "default_ceiling",
}


def _check_name(table: str, column: str) -> str:
    return f"ck_{table}_{column}_range"


def upgrade() -> None:
    for table, column in CEILING_COLUMNS.items():
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column(column, sa.Integer(), nullable=True))
            batch_op.create_check_constraint(
                op.f(_check_name(table, column)),
                f"{column} IS NULL OR ({column} >= 1 AND {column} <= 1000000)",
            )


def downgrade() -> None:
    for table, column in CEILING_COLUMNS.items():
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(op.f(_check_name(table, column)), type_="check")
            batch_op.drop_column(column)
