#!/usr/bin/env bash
# Set everything up and run the test suite (offline: HF_HUB_OFFLINE=1): one pytest-xdist worker per core, each on one
# torch thread (unless OMP_NUM_THREADS / MKL_NUM_THREADS say otherwise), test files shared out whole so that a
# module's fixtures are built once. Extra arguments go to pytest (`-n 0`: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -n auto --dist loadfile "$@"
