"""Indexes of the admin dashboard's job list: newest first with a (created_at, id) keyset, alone,
by status and by tenant.

Built ``CONCURRENTLY`` (outside the migration's transaction) so that a live ``batches`` table keeps
taking writes while they build.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 06:00:00
"""

from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

INDEXES = {
    "ix_batches_created_at_id": ["created_at", "id"],
    "ix_batches_status_created_at_id": ["status", "created_at", "id"],
    "ix_batches_tenant_id_created_at_id": ["tenant_id", "created_at", "id"],
}


def upgrade() -> None:
    with op.get_context().autocommit_block():
        for name, columns in INDEXES.items():
            op.create_index(name, "batches", columns, unique=False, postgresql_concurrently=True,
                            if_not_exists=True)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for name in INDEXES:
            op.drop_index(name, table_name="batches", postgresql_concurrently=True, if_exists=True)
