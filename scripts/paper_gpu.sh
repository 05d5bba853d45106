#!/usr/bin/env bash
# The paper-scale toy study in one command: 2 tasks x 4 regimes x 10 seeds (3000 steps, d_model 128, 2 layers,
# 4 heads, batch 256, lr 1e-3), each (task, regime) trained as one run group of 10 seeds; the 20 vanilla runs
# keeping the exact account at layers 1-2 x positions 2-19 while their groups train (runs begun without it, as by
# --no-replays, are replayed instead, one replay per group over the run axis); probes of the final and the step-0
# weights; the report. Work files go to results/toy-paper (resumable: rerun to continue); the report is copied to
# docs/results/toy-paper/. Meant for a GPU; see docs/run-groups.md for the time it needs. On a machine with several
# GPUs the run groups (and then their replays) take the GPUs in turn, one job per GPU at a time.
#
#   scripts/paper_gpu.sh [WORK_DIR]            the paper scale on the default device (CUDA when available)
#   scripts/paper_gpu.sh --smoke [WORK_DIR]    the same code path at smoke size on the CPU (minutes); no copy to docs/
#   scripts/paper_gpu.sh --no-replays [WORK_DIR]   train and probe only (the gates and probe claims; a few minutes on
#                                                  a GPU); rerun without the flag to add the tracked replays
set -euo pipefail
cd "$(dirname "$0")/.."
# the project's environment (scripts/setup.sh), else the machine's python3 (e.g. a GPU machine's own PyTorch)
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
scale=paper device=auto extra=()
while [[ "${1:-}" == --* ]]; do
  case "$1" in
    --smoke) scale=paper-smoke device=cpu; export CUDA_VISIBLE_DEVICES="" ;;  # train on the CPU too
    --no-replays) extra+=(--no-replays) ;;
    *) echo "paper_gpu.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
work=${1:-results/toy-$scale}
start=$(date +%s)
HF_HUB_OFFLINE=1 "$PYTHON" -m ntpflow -q reproduce toy --scale "$scale" --out "$work" --device "$device" "${extra[@]}"
if [[ "$scale" == paper ]]; then
  mkdir -p docs/results/toy-paper/figures
  cp "$work"/report.md "$work"/summary.json "$work"/stamp.json docs/results/toy-paper/
  cp "$work"/figures/*.png "$work"/figures/*.svg docs/results/toy-paper/figures/
fi
echo "toy study ($scale) finished in $(( $(date +%s) - start )) s; report: $work/report.md"
