"""``background_responses``: the record of background responses (OpenAI's ``POST /v1/responses``
with ``background: true``), and ``tenants.queued_response_limit``, the per-tenant cap on those
still queued (null: the gateway's default).

A new table and a nullable column without a default: nothing existing is rewritten.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-06 08:40:00
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("queued_response_limit", sa.Integer(), nullable=True))
    op.create_table(
        "background_responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), server_default="queued", nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("previous_response_id", sa.String(length=64), nullable=True),
        sa.Column("request", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("input", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("output", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("usage", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("error", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("incomplete_details", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("created_at", sa.BigInteger(), server_default=sa.text("extract(epoch from now())::bigint"),
                  nullable=False),
        sa.Column("in_progress_at", sa.BigInteger(), nullable=True),
        sa.Column("finished_at", sa.BigInteger(), nullable=True),
        sa.Column("deadline", sa.DateTime(timezone=True), nullable=False),
        sa.Column("queue_entry_id", sa.String(length=64), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_background_responses_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_background_responses")),
        sa.UniqueConstraint("seq", name=op.f("uq_background_responses_seq")),
    )
    op.create_index(op.f("ix_background_responses_tenant_id_status"), "background_responses",
                    ["tenant_id", "status"], unique=False)
    op.create_index(op.f("ix_background_responses_status_deadline"), "background_responses",
                    ["status", "deadline"], unique=False)
    op.create_index(op.f("ix_background_responses_tenant_id_seq"), "background_responses",
                    ["tenant_id", "seq"], unique=False)


def downgrade() -> None:
    op.drop_table("background_responses")
    op.drop_column("tenants", "queued_response_limit")
