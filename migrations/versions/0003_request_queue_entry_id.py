"""``batch_requests.queue_entry_id``: the stream entry id of a queued request's message, so the
sweeper can ask the queue whether the message is still there before publishing it again.

A nullable column without a default: adding it rewrites nothing.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 20:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("batch_requests", sa.Column("queue_entry_id", sa.String(length=64), nullable=True))


def downgrade() -> None:
    op.drop_column("batch_requests", "queue_entry_id")
