"""The batch lifecycle, one module per step; every step is safe to run twice and concurrently
(each effect is a compare-and-set in Postgres):

- :mod:`.validator`: validate the input file, write the request rows (``validating → in_progress``
  or ``failed``);
- :mod:`.feeder`: lease pending requests and publish them to the batch lane;
- :mod:`.collector`: record results (the pure mapping is :mod:`.outcomes`);
- :mod:`.sweeper`: renew lapsed leases of requests whose message is still on its way, hand back
  those whose message is gone, re-mark cancelling batches;
- :mod:`.finalizer`: write the output and error files and end the batch (with expiry and cancel).

The step functions are re-exported here (``lifecycle.feed(ctx)``).
"""

from __future__ import annotations

from workers.lifecycle.collector import collect
from workers.lifecycle.feeder import feed
from workers.lifecycle.finalizer import cancel, finalize, finalize_due, output_file_id
from workers.lifecycle.sweeper import sweep

__all__ = ["cancel", "collect", "feed", "finalize", "finalize_due", "output_file_id", "sweep"]
