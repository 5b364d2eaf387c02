"""Built-in plugins (llm-d names); see ``router/scheduling/README.md`` for each one's parameters.

Each module holds one family: prefix-cache producers and scorer, the prefix-affinity filter, load
scorers, session affinity, no-hit LRU, pickers. :mod:`router.scheduling.registry` maps type names to
their factories.
"""
