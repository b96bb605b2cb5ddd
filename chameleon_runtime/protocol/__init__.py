"""The protocol between the launcher and the workers: every store key either side reads
or writes and every message, as typed JSON models (``messages``), the job token that
signs control messages (``seal``), the deadline on a connection to a store (``link``),
and what crosses between the planner's types and the wire: a job's description and a
plan message (``wire``).

The launcher imports this package and nothing else of ``chameleon_runtime`` (it is
torch-free); the workers import it; the pure planner does not (tests/test_architecture.py).
Nothing here is unpickled: JSON only."""
