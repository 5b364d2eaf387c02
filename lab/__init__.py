"""The measurement wing: the fleet simulator and the benchmarks, beside the services they measure.

Three floors, each importing only those below it:

* :mod:`lab.toolkit` — the shared measuring tools: workloads and traces, arrivals, prompt text,
  replay clients, process launch, the one stats module, charts. It may import the services and
  :mod:`common`.
* :mod:`lab.simulate` — the fleet in virtual time (``backfill simulate``): the toolkit and the
  services.
* :mod:`lab.bench` — the benchmarks (``backfill bench NAME``): the toolkit, the simulator and the
  services.

Nothing but the command line (:mod:`backfill`) names ``lab``, and it does so lazily (by
``"module:command"`` strings or inside functions); ``lab`` never imports :mod:`backfill`.
"""
