#!/usr/bin/env bash
# The paper's OthelloGPT on one GPU: 6 layers, d 256, 4 heads, batch 1024, 5000 steps, lr 1e-3, one epoch
# of fresh random games (5.12 M, token-only in memory: 549 B a game); ridge probes and 3-way classifiers of the 64
# squares for the final and the step-0 weights on 20,480 evaluation games; the report (scale "paper-gpu" of
# ntpflow/experiments/othello.py). With replays: the tracked replay with the exact account (a readout of 256
# evaluation games, per-type risks) at 6 of the paper's 84 sites, layers 3-4 x positions 20, 28, 36, the 16 central
# squares. Work files go to results/othello-paper-gpu (resumable: rerun to continue); the report is copied to
# docs/results/othello-paper/.
#
# Cost (benchmarks/othello_gpu_flops.py: matmul FLOPs by torch's dispatch formulas, counted at batch 8/16 and scaled):
# a plain step is 1.77 TFLOP at batch 1024, so training is 5000 x 1.77e12 = 8.9e15 FLOPs: about 3.7 min at 40 TFLOP/s
# (float32 without TF32 on an H200, whose float32 peak is about 67 TFLOP/s), 5 min at 30; the probes add well under a
# minute. Measured on one H200 (2026-12-04): step 3500 of 5000 after 300 s, about 21 TFLOP/s (the math attention
# kernel on CUDA), so training takes about 7 min: `--no-replays` fits inside 10 minutes, not well inside. With the
# influence (the default), the vanilla run trains with the exact account kept while training (ntpflow train
# --account, with the per-type rows of the 16 central squares): one call, no replay, no second training. A step with
# the account at these 6 sites costs about what a replayed step did: 2.85 plain steps for the batch plus 1.06 for the
# 256 readout games, 3.91 in all (a refined step adds 0.51 a quadrature point), 3.5e16 FLOPs over 5000 steps
# unrefined, about 28 min at the 21 TFLOP/s measured for the training: more than one lent GPU's 15 minutes (the
# paper's 84 sites: 32.8 plain steps, 2.9e17 FLOPs, about 4 h). The call resumes from the training's last checkpoint
# (every ckpt_every steps, the account's running chunk saved with it), so cut calls lose at most one block. A run
# first trained with --no-replays has no account: a later call without it replays that run instead. On a machine with
# several GPUs the vanilla run with the account trains as one worker per GPU (ntpflow train --workers: NCCL, each
# worker on its share of the batch and of the readout), the myopic run after it.
#
# --six runs scale medium-6x6 instead (4 layers, d 128, a 6x6 board: NOT the paper's setting), its vanilla and myopic
# runs, the fragility test and the vanilla run's account at its site (layer 3, position 18), into
# results/othello-medium-6x6-gpu and docs/results/othello-medium-6x6-gpu/ (on this CPU the run with the account takes
# about 3.6 core-hours), so this decides claims (ii)-(iv) on a model with a world model. FLOPs: 2 x 12,000 x 40 GFLOP =
# 9.6e14 of training and 1.2e15 of the account, seconds of arithmetic on an H200 but small kernels: an estimate, not
# measured, of 5-15 min in all; run it as one call, `--six` (it resumes).
#
#   scripts/othello_gpu.sh --no-replays [WORK_DIR]   training, probes, report: the 10-minute call
#   scripts/othello_gpu.sh [WORK_DIR]                trained with the account instead (resumes; about 35 min in all)
#   scripts/othello_gpu.sh --six [--no-replays]      the 6x6 board's scale, with its replays unless --no-replays
#   scripts/othello_gpu.sh --smoke [...]             the same code path at smoke size on the CPU (minutes); no copy
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
scale=paper-gpu device=auto extra=()
while [[ "${1:-}" == --* ]]; do
  case "$1" in
    --smoke) scale=paper-gpu-smoke device=cpu; export CUDA_VISIBLE_DEVICES="" ;;
    --six) scale=medium-6x6 ;;
    --no-replays) extra+=(--no-replays) ;;
    *) echo "othello_gpu.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
case "$scale" in  # the committed copy of the report, and the default work folder
  paper-gpu) dest=docs/results/othello-paper work=results/othello-paper-gpu ;;
  medium-6x6) dest=docs/results/othello-medium-6x6-gpu work=results/othello-medium-6x6-gpu ;;
  *) dest="" work=results/othello-$scale ;;
esac
work=${1:-$work}
start=$(date +%s)
HF_HUB_OFFLINE=1 "$PYTHON" -m ntpflow -q reproduce othello --scale "$scale" --out "$work" --device "$device" "${extra[@]}"
if [[ -n "$dest" ]]; then
  mkdir -p "$dest"/figures
  cp "$work"/report.md "$work"/summary.json "$work"/stamp.json "$work"/data.json "$work"/timings.json "$dest"/
  cp "$work"/figures/*.png "$work"/figures/*.svg "$dest"/figures/ 2>/dev/null || true
fi
echo "othello ($scale) finished in $(( $(date +%s) - start )) s; report: $work/report.md"
