"""The enqueued-token quota's wording (``batch_gateway.store.quota``)."""

from __future__ import annotations

from batch_gateway.store.quota import token_limit_message


def test_token_limit_message_uses_openai_wording():
    assert token_limit_message("acme", 1_000_000) == (
        "Enqueued token limit reached for this model in organization acme. Limit: 1,000,000 enqueued "
        "tokens. Please try again once some in_progress batches have been completed.")
    assert token_limit_message("acme", 5, "gpt-x").startswith("Enqueued token limit reached for gpt-x in ")
