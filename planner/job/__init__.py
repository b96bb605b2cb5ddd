"""The job and its costs: what is trained on what (``workload``: the cluster, the model's
layers, the training settings), what a layer, a link and a host cost (``cost``, a
profile's measured ``costtable``), and how often things fail (``failures``: device and
node rates, the causes' mix, D learned from a run). Imports nothing else of the planner."""
