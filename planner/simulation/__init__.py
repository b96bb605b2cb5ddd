"""The whole-run simulator: failure traces (``trace``), every policy over a trace on the
planner's own answers (``simulate``, cached across runs by ``answers`` and ``symmetry``),
the best choices in hindsight (``oracle``), the per-policy outcomes (``outcome``), and a
run's measured costs to replay on (``calibration``). What ``chameleon simulate`` runs.
Imports everything above it; nothing of the planner imports it."""
