"""The load generator behind ``kvfleet bench`` and ``kvfleet tune``, in layers:

    workload, records, analysis, search, config   pure: what to send, what came back, what it means
    client, samplers                               the wire: one request through the public API; the
                                                   servers' own counters (block_service, /metrics, RSS)
    phases                                         fixed / mixed / soak, built from the two above
    report, plots, progress                        summary.json, CSV, PNG; bars on a terminal

The commands (``kvfleet_cli.bench_command``, ``kvfleet_cli.tune_command``) only parse flags, start
a local cluster when asked, and call the phases.
"""
