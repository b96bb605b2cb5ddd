#!/usr/bin/env bash
# Install chameleon for development. A torch already installed in the tested range
# (pyproject.toml: 2.13 and 2.14) is kept; otherwise the CPU build of torch 2.13.0 goes in
# first: an unpinned torch would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "
import sys, torch
major, minor = (int(x) for x in torch.__version__.split('.')[:2])
sys.exit(0 if (2, 13) <= (major, minor) < (2, 15) else 1)" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet torch==2.13.0
fi
# torch's CPU wheel does not require numpy but warns "Failed to initialize NumPy" at
# every import without it: in every worker's stderr, on every start.
if ! "$PYTHON" -c "import numpy" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet numpy
fi
# hf: examples/train_hf.py and its tests (transformers, pinned); plot: simulate --plot
"$PYTHON" -m pip install --quiet -e '.[dev,hf,plot]'
# --rdzv-backend etcd is tested against a real 3-member etcd cluster (tests/etcd): the
# server comes from Debian's etcd-server package (etcd 3.4), put on PATH as /usr/bin/etcd.
if ! command -v etcd >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get install -y -q etcd-server >/dev/null 2>&1 ||
        { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q etcd-server >/dev/null; }
fi
# tests/partitions put nodes in network namespaces with iproute2's `ip` (as root).
if ! command -v ip >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get install -y -q iproute2 >/dev/null 2>&1 ||
        { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q iproute2 >/dev/null; } ||
        echo "could not install iproute2: tests/partitions will skip" >&2
fi
