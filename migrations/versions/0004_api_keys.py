"""API keys: the api_keys table; engines.api_applied_version (the engine's API server)

Revision ID: 0004
Revises: 0003
Create Date: 2027-01-20
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=12), nullable=False),
        sa.Column(
            "user",
            sa.String(length=256).with_variant(sa.String(length=256, collation="C"), "postgresql"),
            nullable=False,
        ),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
    )
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_keys_user"), ["user"], unique=False)
    with op.batch_alter_table("engines", schema=None) as batch_op:
        batch_op.add_column(sa.Column("api_applied_version", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("engines", schema=None) as batch_op:
        batch_op.drop_column("api_applied_version")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_keys_user"))
    op.drop_table("api_keys")
