#!/usr/bin/env bash
# Set everything up and run the test suite (offline: HF_HUB_OFFLINE=1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q "$@"
