"""usage history: the time-weighted limit in force per minute (limit_weight,
limited_seconds, limited_tokens) and the seconds the reports covered (reported_seconds)

Rows written before this revision held only the limit when the minute was last written
(limit_rate): they are taken as a whole minute reported under that limit.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

MINUTE_S = 60
COLUMNS = ("reported_seconds", "limited_seconds", "limit_weight", "limited_tokens")

usage_minutes = sa.table(
    "usage_minutes",
    sa.column("tokens", sa.BigInteger()),
    sa.column("limit_rate", sa.Integer()),
    sa.column("reported_seconds", sa.Float()),
    sa.column("limited_seconds", sa.Float()),
    sa.column("limit_weight", sa.Float()),
    sa.column("limited_tokens", sa.Float()),
)


def upgrade() -> None:
    with op.batch_alter_table("usage_minutes", schema=None) as batch_op:
        for name in COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Float(), nullable=False, server_default="0"))
    limited = usage_minutes.c.limit_rate.is_not(None)
    op.execute(usage_minutes.update().values(reported_seconds=MINUTE_S))
    op.execute(
        usage_minutes.update()
        .where(limited)
        .values(
            limited_seconds=MINUTE_S,
            limit_weight=usage_minutes.c.limit_rate * MINUTE_S,
            limited_tokens=usage_minutes.c.tokens,
        )
    )


def downgrade() -> None:
    with op.batch_alter_table("usage_minutes", schema=None) as batch_op:
        for name in reversed(COLUMNS):
            batch_op.drop_column(name)
