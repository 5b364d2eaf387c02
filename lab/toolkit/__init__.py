"""The shared measuring tools of the simulator and the benchmarks: workloads and traces
(:mod:`~lab.toolkit.workloads`, :mod:`~lab.toolkit.pd_mix`), arrivals, prompt text, replay clients
(:mod:`~lab.toolkit.replay`, :mod:`~lab.toolkit.interactive`), process launch
(:mod:`~lab.toolkit.launch`, :mod:`~lab.toolkit.stack`), the one stats module
(:mod:`~lab.toolkit.stats`), charts and the options shared by commands. It may import the services
and :mod:`common`, never the simulator, the benchmarks or the command line."""
