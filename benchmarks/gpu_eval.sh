#!/usr/bin/env bash
# The GPU evaluation benchmark (issue 3) as one prepared run on the device machine:
# a Qwen3.6-27B-shaped random drafter on a synthetic cache, 8 samples with the per-cycle loop on one,
# then the full 64 x 2048 evaluation. Figures go to $OUT (or ./gpu_out).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/nvidia_smi.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 benchmarks/eval.py --preset qwen36-27b --device cuda --samples 8 --loop-samples 1 \
    --json "$OUT/gpu_8.json" --cache-dir /tmp/bench8 2>&1 | tee "$OUT/log_8.txt"
rm -rf /tmp/bench8
python3 benchmarks/eval.py --preset qwen36-27b --device cuda --samples 64 --loop-samples 0 \
    --json "$OUT/gpu_64.json" --cache-dir /tmp/bench64 "$@" 2>&1 | tee "$OUT/log_64.txt"
