#!/usr/bin/env bash
# Set everything up and run the main job: every experiment at its smoke size (toy tasks, Othello, TinyStories on the
# generated corpus, Q(w) on a tiny model), then one self-contained report; prints where the report is.
# (`ntpflow demo` is the smaller quick look: the majority task in the four regimes and its probe table.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
HF_HUB_OFFLINE=1 .venv/bin/ntpflow reproduce all --scale smoke --out "${1:-results/demo}"
