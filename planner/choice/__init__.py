"""Recovery policies and the choice: each candidate recovery for a failure (``policy``:
reroute, re-partition, restart, with their transitions), the risk the layout it leaves
takes at the next failure (``risk``), the score that picks one and the decision it
makes (``selection``), and its report (``report``). What ``chameleon run`` asks at a
failure and ``chameleon plan --dry-run`` shows. Imports everything above it."""
