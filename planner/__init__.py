"""The planner: pure functions from a job and a failure to the recovery that finishes
the job soonest. No processes, sockets or torch (tests/test_architecture.py).

Its subpackages are the stages a plan goes through, and each imports only those above it:

    job         the job and its costs: cluster, model layers, training, failure rates
    plans       layouts, per-worker programs, the launch layout, reroutes, migrations
    estimator   a plan's step and transition, timed over the workers' own programs
    search      the layouts worth considering over the live workers
    choice      the candidate recoveries, the risk each takes, the score that picks one
    simulation  every policy over whole failure traces, and the oracle

``planner.config`` reads a job's TOML (and its profile's cost table) into a ``Job``:
the one module outside them, since fitting a profile uses the estimator.
docs/planner.md explains the model; docs/overview.md shows where the planner sits.
"""
