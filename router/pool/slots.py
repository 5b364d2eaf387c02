"""Slot learning: an engine's sequence slots (vLLM's ``--max-num-seqs``) read off its scrapes.

vLLM does not export ``max_num_seqs``. Each scrape raises ``peak_running``, the most requests the
engine was seen running (a lower bound of ``max_num_seqs``), and once a scrape shows it running
requests while others wait — it was full — ``learned_max_num_seqs`` is set to ``peak_running`` and
kept equal from then on (every scrape's running count is at most ``max_num_seqs``, so the largest
is the best estimate; the one at a scrape with waiting requests alone may be low when the engine's
token budget, not its slots, held a prefill back). A configured ``max_num_seqs`` overrides it
(:attr:`router.scheduling.types.Endpoint.slots`). Both are forgotten when the endpoint goes down
(:func:`forget_slots`): it may come back as another engine.
"""

from __future__ import annotations

from router.scheduling.types import Endpoint


def learn_slots(endpoint: Endpoint, running: int, waiting: int) -> None:
    """Learn from one scrape showing ``running`` and ``waiting`` requests (module docstring)."""
    endpoint.peak_running = max(endpoint.peak_running, running)
    if endpoint.learned_max_num_seqs is not None or (waiting > 0 and running > 0):
        endpoint.learned_max_num_seqs = endpoint.peak_running  # it was full once: peak_running is its batch size


def forget_slots(endpoint: Endpoint) -> None:
    """Forget what was learned (the endpoint went down)."""
    endpoint.peak_running = 0
    endpoint.learned_max_num_seqs = None
