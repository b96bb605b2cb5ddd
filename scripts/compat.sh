#!/usr/bin/env bash
# The compatibility run: the newest torch that pyproject.toml admits (2.14.1, a CUDA build,
# run here on the CPU) in a venv of its own, with the project installed into it as a user
# would; then the fast tier and one multi-process test of each recovery path. The venv
# (about 5.5 GB; 91 s to make from this host's disk) is kept under ~/.cache/chameleon, so
# only the first run pays for the wheels. Alone and warm it takes 2:40 here (the install
# 7 s, the fast tier 51 s, the five multi-process tests 85-100 s on 2.14's heavier
# import); `CHAMELEON_CI_COMPAT=1 bash .ci/run` runs it beside the main suite, one test
# at a time (`-n 1`).
#   bash scripts/compat.sh [pytest args for both runs]
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${CHAMELEON_COMPAT_TORCH:-2.14.1}
VENV=${CHAMELEON_COMPAT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/chameleon/venv-torch-$TORCH}
PY="$VENV/bin/python"
has_torch() {
    "$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null
}
if ! has_torch; then
    echo "compat: making $VENV with torch $TORCH (once)" >&2
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$PY" -m pip install --quiet "torch==$TORCH" numpy "setuptools>=68"
fi
# The project goes in the way the README says; pip must keep the torch that is there.
# (With the venv's own setuptools, the one pyproject.toml asks for: an isolated build would
# install one each run, 5 s.)
"$PY" -m pip install --quiet "setuptools>=68"
"$PY" -m pip install --quiet --no-build-isolation -e '.[dev,hf,plot]'
has_torch || { echo "compat: installing chameleon replaced torch $TORCH" >&2; exit 1; }
echo "compat: torch $("$PY" -c 'import torch; print(torch.__version__)')" >&2
# The fast tier, less the tests torch cannot reach (the planner's: tests/torchfree.py),
# which pass or fail alike on every torch and run in CI's main run.
"$PY" -m pytest -q -m "not slow and not torch_free" "$@"
# One test of each recovery path, with real processes: a plain script restarted, the
# Trainer re-partitioned in place, the drop-in healing a replacement, HSDP re-sharding a
# group, and a job whose control plane is a real etcd cluster.
CHAMELEON_REQUIRE_ETCD=1 "$PY" -m pytest -q "$@" \
    tests/launcher/test_launch.py::test_restart_counts_and_then_succeeds \
    "tests/runtime/test_recovery.py::test_in_place_recovery_keeps_training_identical[reparallelize]" \
    "tests/runtime/test_dropin.py::test_a_replacement_heals_after_the_script_resumed_from_its_checkpoint[taken-in]" \
    tests/runtime/test_hsdp.py::test_a_kill_re_shards_the_group_then_grows_it_back_whole \
    tests/etcd/test_etcd_job.py::test_a_node_joining_late_grows_the_job
