#!/usr/bin/env bash
# What CI leaves out (tests marked soak): the long runs (the chaos soak, the 2,000-step heal
# soak, the 2,500-step bounded-store run, simulate against a real run) and the second
# cases of a path CI runs once (each says where CI runs its path). Run them before
# resolving any change that touches recovery:  bash scripts/soak.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
# one at a time (-n 0): simulate-against-real compares a measured throughput
exec python3 -m pytest -q -n 0 -m soak "$@"
