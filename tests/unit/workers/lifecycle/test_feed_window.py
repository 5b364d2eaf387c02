"""The feed window stays within the processor's batch-lane buffer (issue 12): every queued line of
a batch fits in the processor, so another tenant's lines never wait behind it in the stream."""

from __future__ import annotations

from async_processor.settings import ProcessorSettings
from workers.settings import WorkerSettings


def test_the_default_feed_window_fits_the_processors_batch_buffer():
    window = WorkerSettings.model_fields["feed_window"].default
    processor = ProcessorSettings(backend="memory")
    assert 0 < window <= processor.lane_capacity()["batch"]
