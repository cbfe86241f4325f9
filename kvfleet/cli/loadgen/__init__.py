"""The load generator behind ``kvfleet bench`` and ``kvfleet tune``, in layers:

    workload, records, analysis, search   pure: what to send, what came back, what it means, which
                                          block size to try next
    client, samplers, server_side         the wire: one request through the public API; the servers'
                                          own figures (block_service's blocks, /metrics, RSS)
    phases, session, local                fixed / mixed / soak built from those; one run against one
                                          router; a local cluster with a tenant out of the way
    report, tune_report, plots, progress  summary.json, CSV, PNG, the winner's config; bars on a terminal

The commands (``kvfleet.cli.bench_command``, ``kvfleet.cli.tune_command``) only parse flags,
validate, and call ``session.run_session``.
"""
