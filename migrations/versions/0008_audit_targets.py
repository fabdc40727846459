"""typed audit targets: audit_log.target_kind; audit_targets, the users of each bulk entry

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# action -> the kind of its target, for every action written before this revision.
KIND_OF_ACTION = {
    "put_limit": "user",
    "patch_limit": "user",
    "delete_limit": "user",
    "create_key": "user",
    "revoke_key": "user",
    "put_tier": "tier",
    "patch_tier": "tier",
    "delete_tier": "tier",
    "put_default": "default",
    "create_token": "token",
    "revoke_token": "token",
    "bulk_put_limits": "bulk",
}
KINDS = ("user", "tier", "default", "token", "bulk")
# Token entries' targets were "token:<id>"; their id within the kind is "<id>".
TOKEN_PREFIX = "token:"
BULK_ACTION = "bulk_put_limits"
# audit_targets rows inserted per statement while filling it.
INSERT_BATCH = 5000

audit_log = sa.table(
    "audit_log",
    sa.column("id", sa.Integer()),
    sa.column("action", sa.String()),
    sa.column("target_kind", sa.String()),
    sa.column("target", sa.String()),
    sa.column("before", sa.JSON()),
    sa.column("after", sa.JSON()),
)


def _user_changes(audit_id: int, before: object, after: object) -> list[dict[str, object]]:
    """The audit_targets rows of a bulk entry: each user of its before and after maps,
    with its record on each side."""
    before_, after_ = (side if isinstance(side, dict) else {} for side in (before, after))
    return [
        {
            "user": u,
            "audit_id": audit_id,
            "change": {"before": before_.get(u), "after": after_.get(u)},
        }
        for u in sorted(before_.keys() | after_.keys())
    ]


def upgrade() -> None:
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.add_column(sa.Column("target_kind", sa.String(length=7), nullable=True))
    kind_of = sa.case(KIND_OF_ACTION, value=audit_log.c.action)
    op.execute(audit_log.update().values(target_kind=kind_of))
    unknown = op.get_bind().execute(
        sa.select(audit_log.c.action).where(audit_log.c.target_kind.is_(None)).distinct()
    )
    actions = sorted(row.action for row in unknown)
    if actions:
        raise RuntimeError(f"audit_log has actions this migration does not know: {actions}")
    is_token = audit_log.c.target_kind == "token"
    op.execute(
        audit_log.update()
        .where(is_token, audit_log.c.target.startswith(TOKEN_PREFIX, autoescape=True))
        .values(target=sa.func.substr(audit_log.c.target, len(TOKEN_PREFIX) + 1))
    )
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.alter_column("target_kind", existing_type=sa.String(length=7), nullable=False)
        batch_op.create_check_constraint(
            op.f("ck_audit_log_target_kind_valid"),
            "target_kind IN ({})".format(", ".join(f"'{k}'" for k in KINDS)),
        )
        batch_op.create_index(
            "ix_audit_log_target_kind_target_id", ["target_kind", "target", "id"], unique=False
        )
        batch_op.create_index("ix_audit_log_target_kind_id", ["target_kind", "id"], unique=False)
    audit_targets = op.create_table(
        "audit_targets",
        sa.Column(
            "user",
            sa.String(length=256).with_variant(sa.String(length=256, collation="C"), "postgresql"),
            nullable=False,
        ),
        sa.Column("audit_id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("change", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["audit_id"],
            ["audit_log.id"],
            name=op.f("fk_audit_targets_audit_id_audit_log"),
        ),
        sa.PrimaryKeyConstraint("user", "audit_id", name=op.f("pk_audit_targets")),
        sqlite_with_rowid=False,
    )
    _fill_audit_targets(audit_targets)


def _fill_audit_targets(audit_targets: sa.Table) -> None:
    """One row per user of every bulk entry, read one entry at a time (a bulk entry's
    JSON holds up to 10,000 users' records)."""
    conn = op.get_bind()
    bulk_ids = conn.execute(
        sa.select(audit_log.c.id).where(audit_log.c.action == BULK_ACTION).order_by("id")
    ).scalars()
    for audit_id in list(bulk_ids):
        entry = conn.execute(
            sa.select(audit_log.c.before, audit_log.c.after).where(audit_log.c.id == audit_id)
        ).one()
        rows = _user_changes(audit_id, entry.before, entry.after)
        for start in range(0, len(rows), INSERT_BATCH):
            conn.execute(audit_targets.insert(), rows[start : start + INSERT_BATCH])


def downgrade() -> None:
    op.drop_table("audit_targets")
    op.execute(
        audit_log.update()
        .where(audit_log.c.target_kind == "token")
        .values(target=sa.literal(TOKEN_PREFIX) + audit_log.c.target)
    )
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.drop_index("ix_audit_log_target_kind_id")
        batch_op.drop_index("ix_audit_log_target_kind_target_id")
        batch_op.drop_constraint(op.f("ck_audit_log_target_kind_valid"), type_="check")
        batch_op.drop_column("target_kind")
