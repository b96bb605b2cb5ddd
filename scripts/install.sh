#!/usr/bin/env bash
# Install chameleon for development. A CPU build of torch 2.13.0 goes in first when no
# torch is installed: an unpinned torch would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet torch==2.13.0
fi
# torch's CPU wheel does not require numpy but warns "Failed to initialize NumPy" at
# every import without it: in every worker's stderr, on every start.
if ! "$PYTHON" -c "import numpy" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet numpy
fi
"$PYTHON" -m pip install --quiet -e '.[dev]'
