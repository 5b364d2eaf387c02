"""Every query of the gateway and the workers, one module per table; the only place with SQL.

- :mod:`.tenants`: tenants and API keys, quotas, webhook endpoints;
- :mod:`.files`: uploads, listing, deletion, output files, purging;
- :mod:`.batches`: create, read, list, the guarded status change, cancel, lifecycle candidates;
- :mod:`.requests`: a batch's requests: the COPY, leases, outcomes, the stream files are built from;
- :mod:`.events`: timeline, outbox, webhook deliveries, trace contexts;
- :mod:`.admin`: the dashboard's reports over every tenant;
- :mod:`.activity`: whether the lifecycle has anything to do (beat's probe);
- :mod:`.operator`: the operator command line's pages and totals over every tenant.

Each function takes the session and, where rows belong to a tenant, the tenant id explicitly. None
commits: the caller owns the transaction. Each status change is one compare-and-set UPDATE
(:func:`~.batches.transition`) that also writes its event row, so a change and its outbox entry
commit together; time comes from the database clock. Callers use this package's names
(``queries.transition``), re-exported below.
"""

from __future__ import annotations

from batch_gateway.store.queries._shared import can_exist, new_id
from batch_gateway.store.queries.activity import lifecycle_work_pending
from batch_gateway.store.queries.admin import (
    ERROR_BODY_BYTES,
    OPEN_REQUEST_STATES,
    BatchCursor,
    BatchFilter,
    admin_count_batches,
    admin_get_batch,
    admin_list_batches,
    admin_request_page,
    batch_events,
    batch_status_counts,
    ended_unrun_counts,
    open_requests_by_tenant,
    request_state_counts,
    tenant_usage,
)
from batch_gateway.store.queries.batches import (
    CANCEL_RULE,
    CancelOutcome,
    batch_status,
    batches_to_finalize,
    cancelling_batch_ids,
    enqueued_tokens,
    feedable_batches,
    get_batch,
    get_batch_by_idempotency_key,
    insert_batch,
    list_batches,
    lock_batch,
    past_deadline,
    request_cancel,
    stale_validating_batches,
    terminal_cancel_refusal,
    transition,
)
from batch_gateway.store.queries.events import (
    WEBHOOK_EVENTS,
    add_event,
    batch_traceparents,
    due_webhooks,
    mark_published,
    unpublished_events,
    webhook_attempted,
)
from batch_gateway.store.queries.files import (
    delete_file,
    file_in_use,
    get_any_file,
    get_file,
    insert_file,
    list_files,
    mark_purged,
    purgeable_files,
    upsert_output_file,
)
from batch_gateway.store.queries.operator import all_files_page, count_all_batches, count_all_files, count_tenants
from batch_gateway.store.queries.requests import (
    OUTCOME_COLUMNS,
    TERMINAL_REQUEST_STATES,
    claim_pending,
    count_requests,
    end_open_requests,
    lapsed_leases,
    record_outcome,
    record_queue_entries,
    renew_leases,
    replace_requests,
    request_outcomes,
    succeed_all_requests,
)
from batch_gateway.store.queries.tenants import (
    KEY_PREFIX,
    AmbiguousKeyPrefix,
    add_api_key,
    ensure_tenant,
    hash_key,
    list_api_keys,
    lock_tenant,
    revoke_api_key,
    set_enqueued_token_limit,
    set_queued_response_limit,
    set_webhook,
    shown_prefix,
    tenant_by_name,
    tenant_for_key,
    tenant_names,
)

__all__ = [
    "ERROR_BODY_BYTES", "KEY_PREFIX", "OPEN_REQUEST_STATES", "OUTCOME_COLUMNS", "TERMINAL_REQUEST_STATES",
    "WEBHOOK_EVENTS", "BatchCursor", "add_api_key", "add_event", "admin_get_batch", "admin_list_batches",
    "admin_request_page", "batch_events", "batch_status", "batch_status_counts", "batch_traceparents",
    "batches_to_finalize", "can_exist", "CANCEL_RULE", "CancelOutcome", "terminal_cancel_refusal",
    "request_cancel", "cancelling_batch_ids", "claim_pending",
    "count_requests", "delete_file", "due_webhooks", "end_open_requests", "enqueued_tokens", "ensure_tenant",
    "feedable_batches", "file_in_use", "get_any_file", "get_batch", "get_batch_by_idempotency_key", "get_file",
    "hash_key", "insert_batch", "insert_file", "lapsed_leases", "lifecycle_work_pending", "all_files_page", "count_all_batches",
    "count_all_files", "count_tenants", "list_api_keys", "list_batches", "list_files",
    "lock_batch", "lock_tenant", "mark_published", "mark_purged", "new_id", "open_requests_by_tenant",
    "past_deadline", "purgeable_files", "record_outcome", "record_queue_entries", "renew_leases", "replace_requests", "request_outcomes",
    "request_state_counts", "revoke_api_key", "set_enqueued_token_limit", "set_queued_response_limit", "set_webhook", "stale_validating_batches",
    "succeed_all_requests", "tenant_by_name", "tenant_for_key", "tenant_names", "tenant_usage", "transition",
    "unpublished_events", "upsert_output_file", "webhook_attempted",
    "BatchFilter", "admin_count_batches", "ended_unrun_counts", "AmbiguousKeyPrefix", "shown_prefix",
]
