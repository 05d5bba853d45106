#!/usr/bin/env bash
# Set everything up and run the main job: majority task in the four regimes, then the probe table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
HF_HUB_OFFLINE=1 .venv/bin/ntpflow demo --out "${1:-runs/demo}"
