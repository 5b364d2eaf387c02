"""The fleet simulator: the whole fleet in virtual time with the production router and processor code
(``backfill simulate``, docs/simulate.md)."""
