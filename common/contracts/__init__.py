"""Wire contracts, one module each; every producer and consumer of a format imports it from here.

========================  =========================================================================
:mod:`.queue`             request/result messages of the queues, every stream, topic, group and
                          marker name (``../shared/contracts/queue-and-headers.md``)
:mod:`.router_state`      the router's ``GET /admin/state`` JSON (router, processor gate, dashboard)
:mod:`.openai_request`    the output tokens an OpenAI request body asks for (``max_tokens`` × ``n``)
:mod:`.errors`            OpenAI's error envelope ``{"error": {message, type, param, code}}`` and
                          its ``type`` vocabulary
========================  =========================================================================
"""
