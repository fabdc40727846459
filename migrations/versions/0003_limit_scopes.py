"""limit scopes: a nullable scope on users and tiers, a default scope on the config row

Revision ID: 0003
Revises: 0002
Create Date: 2027-01-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# table -> its scope column (null: inherit)
SCOPE_COLUMNS = {"user_limits": "scope", "tiers": "scope", "config_state": "default_scope"}


def _check_name(table: str, column: str) -> str:
    return f"ck_{table}_{column}_valid"


def upgrade() -> None:
    for table, column in SCOPE_COLUMNS.items():
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column(column, sa.String(length=6), nullable=True))
            batch_op.create_check_constraint(
                op.f(_check_name(table, column)),
                f"{column} IS NULL OR {column} IN ('fleet', 'engine')",
            )


def downgrade() -> None:
    for table, column in SCOPE_COLUMNS.items():
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(op.f(_check_name(table, column)), type_="check")
            batch_op.drop_column(column)
