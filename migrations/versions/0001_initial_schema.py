"""Initial schema: tenants, api_keys, files, batches, batch_requests, events (outbox).

Revision ID: 0001
Revises: 
Create Date: 2026-11-30 02:55:36.315554
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('tenants',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=256), nullable=False),
    sa.Column('enqueued_token_limit', sa.BigInteger(), nullable=True),
    sa.Column('webhook_url', sa.Text(), nullable=True),
    sa.Column('webhook_secret', sa.String(length=128), nullable=True),
    sa.Column('created_at', sa.BigInteger(), server_default=sa.text('extract(epoch from now())::bigint'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tenants')),
    sa.UniqueConstraint('name', name=op.f('uq_tenants_name'))
    )
    op.create_table('api_keys',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.BigInteger(), server_default=sa.text('extract(epoch from now())::bigint'), nullable=False),
    sa.Column('revoked_at', sa.BigInteger(), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_api_keys_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_keys')),
    sa.UniqueConstraint('key_hash', name=op.f('uq_api_keys_key_hash'))
    )
    op.create_index(op.f('ix_api_keys_tenant_id'), 'api_keys', ['tenant_id'], unique=False)
    op.create_table('files',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('seq', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.BigInteger(), server_default=sa.text('extract(epoch from now())::bigint'), nullable=False),
    sa.Column('expires_at', sa.BigInteger(), nullable=True),
    sa.Column('filename', sa.String(length=512), nullable=False),
    sa.Column('purpose', sa.String(length=32), nullable=False),
    sa.Column('status', sa.String(length=16), server_default='processed', nullable=False),
    sa.Column('status_details', sa.Text(), nullable=True),
    sa.Column('storage_key', sa.String(length=256), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=True),
    sa.Column('deleted_at', sa.BigInteger(), nullable=True),
    sa.Column('purged_at', sa.BigInteger(), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_files_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_files')),
    sa.UniqueConstraint('seq', name=op.f('uq_files_seq'))
    )
    op.create_index('ix_files_purgeable', 'files', ['expires_at'], unique=False, postgresql_where=sa.text('purged_at IS NULL'))
    op.create_index(op.f('ix_files_tenant_id_purpose_seq'), 'files', ['tenant_id', 'purpose', 'seq'], unique=False)
    op.create_table('batches',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('seq', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('endpoint', sa.String(length=64), nullable=False),
    sa.Column('model', sa.String(length=256), nullable=True),
    sa.Column('errors', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('input_file_id', sa.String(length=64), nullable=False),
    sa.Column('completion_window', sa.String(length=16), nullable=False),
    sa.Column('window_seconds', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), server_default='validating', nullable=False),
    sa.Column('output_file_id', sa.String(length=64), nullable=True),
    sa.Column('error_file_id', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.BigInteger(), server_default=sa.text('extract(epoch from now())::bigint'), nullable=False),
    sa.Column('in_progress_at', sa.BigInteger(), nullable=True),
    sa.Column('expires_at', sa.BigInteger(), nullable=False),
    sa.Column('finalizing_at', sa.BigInteger(), nullable=True),
    sa.Column('completed_at', sa.BigInteger(), nullable=True),
    sa.Column('failed_at', sa.BigInteger(), nullable=True),
    sa.Column('expired_at', sa.BigInteger(), nullable=True),
    sa.Column('cancelling_at', sa.BigInteger(), nullable=True),
    sa.Column('cancelled_at', sa.BigInteger(), nullable=True),
    sa.Column('deadline', sa.DateTime(timezone=True), nullable=False),
    sa.Column('request_total', sa.Integer(), server_default='0', nullable=False),
    sa.Column('request_completed', sa.Integer(), server_default='0', nullable=False),
    sa.Column('request_failed', sa.Integer(), server_default='0', nullable=False),
    sa.Column('usage_input_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('usage_cached_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('usage_output_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('usage_reasoning_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('metadata', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('output_expires_after', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('idempotency_key', sa.String(length=256), nullable=True),
    sa.Column('request_hash', sa.String(length=64), nullable=True),
    sa.Column('enqueued_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.ForeignKeyConstraint(['error_file_id'], ['files.id'], name=op.f('fk_batches_error_file_id_files')),
    sa.ForeignKeyConstraint(['input_file_id'], ['files.id'], name=op.f('fk_batches_input_file_id_files')),
    sa.ForeignKeyConstraint(['output_file_id'], ['files.id'], name=op.f('fk_batches_output_file_id_files')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_batches_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_batches')),
    sa.UniqueConstraint('seq', name=op.f('uq_batches_seq')),
    sa.UniqueConstraint('tenant_id', 'idempotency_key', name=op.f('uq_batches_tenant_id_idempotency_key'))
    )
    op.create_index(op.f('ix_batches_status_deadline'), 'batches', ['status', 'deadline'], unique=False)
    op.create_index(op.f('ix_batches_tenant_id_seq'), 'batches', ['tenant_id', 'seq'], unique=False)
    op.create_table('batch_requests',
    sa.Column('batch_id', sa.String(length=64), nullable=False),
    sa.Column('custom_id', sa.Text(), nullable=False),
    sa.Column('line', sa.Integer(), nullable=False),
    sa.Column('byte_offset', sa.BigInteger(), nullable=False),
    sa.Column('byte_length', sa.Integer(), nullable=False),
    sa.Column('prefix_key', sa.LargeBinary(), nullable=False),
    sa.Column('est_tokens', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=16), server_default='pending', nullable=False),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('lease_token', sa.UUID(as_uuid=False), nullable=True),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('status_code', sa.Integer(), nullable=True),
    sa.Column('request_id', sa.String(length=128), nullable=True),
    sa.Column('response_body', sa.LargeBinary(), nullable=True),
    sa.Column('error_code', sa.String(length=64), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('prompt_tokens', sa.Integer(), nullable=True),
    sa.Column('cached_tokens', sa.Integer(), nullable=True),
    sa.Column('completion_tokens', sa.Integer(), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['batch_id'], ['batches.id'], name=op.f('fk_batch_requests_batch_id_batches'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('batch_id', 'custom_id', name=op.f('pk_batch_requests'))
    )
    op.create_index(op.f('ix_batch_requests_batch_id_state'), 'batch_requests', ['batch_id', 'state'], unique=False)
    op.create_table('events',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('batch_id', sa.String(length=64), nullable=True),
    sa.Column('tenant_id', sa.String(length=64), nullable=True),
    sa.Column('type', sa.String(length=64), nullable=False),
    sa.Column('payload', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('needs_publish', sa.Boolean(), server_default='false', nullable=False),
    sa.Column('published_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('webhook_attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('webhook_next_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('webhook_done_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['batch_id'], ['batches.id'], name=op.f('fk_events_batch_id_batches'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events'))
    )
    op.create_index(op.f('ix_events_batch_id_id'), 'events', ['batch_id', 'id'], unique=False)
    op.create_index('ix_events_unpublished', 'events', ['id'], unique=False, postgresql_where=sa.text('needs_publish AND published_at IS NULL'))
    op.create_index('ix_events_webhook_due', 'events', ['webhook_next_at'], unique=False, postgresql_where=sa.text('webhook_next_at IS NOT NULL AND webhook_done_at IS NULL'))


def downgrade() -> None:
    op.drop_index('ix_events_webhook_due', table_name='events', postgresql_where=sa.text('webhook_next_at IS NOT NULL AND webhook_done_at IS NULL'))
    op.drop_index('ix_events_unpublished', table_name='events', postgresql_where=sa.text('needs_publish AND published_at IS NULL'))
    op.drop_index(op.f('ix_events_batch_id_id'), table_name='events')
    op.drop_table('events')
    op.drop_index(op.f('ix_batch_requests_batch_id_state'), table_name='batch_requests')
    op.drop_table('batch_requests')
    op.drop_index(op.f('ix_batches_tenant_id_seq'), table_name='batches')
    op.drop_index(op.f('ix_batches_status_deadline'), table_name='batches')
    op.drop_table('batches')
    op.drop_index(op.f('ix_files_tenant_id_purpose_seq'), table_name='files')
    op.drop_index('ix_files_purgeable', table_name='files', postgresql_where=sa.text('purged_at IS NULL'))
    op.drop_table('files')
    op.drop_index(op.f('ix_api_keys_tenant_id'), table_name='api_keys')
    op.drop_table('api_keys')
    op.drop_table('tenants')
