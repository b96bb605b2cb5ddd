"""Plans and per-worker programs: a layout of layers over workers and the routes of
micro-batches through it (``plan``), the program each worker runs for a step
(``program``: one schedule for the runtime and the estimator), the launch layout
(``layout``), balanced splits of layers (``partition``), a host's load (``load``), and
the moves between layouts: who takes over a lost worker's micro-batches (``reroute``)
and the transfers that give a new layout its layers (``migration``, with ``matching`` and
``colouring`` to pair and schedule them). Its JSON form for files and messages is
``planjson``. Imports ``planner.job``."""
