"""``python -m backfill`` is the ``backfill`` command."""

from backfill.cli import main

main()
