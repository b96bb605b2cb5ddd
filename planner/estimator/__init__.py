"""The estimator: what a plan's step costs (``estimate``), timed over the very programs
the workers run (``timing``, ``wavefront`` for rerouted pipelines, ``sharing`` for workers
that share a host's cores), what moving to it costs (``transition``), and the fits that
calibrate both to measured steps (``fit``). Imports ``planner.job`` and ``planner.plans``."""
