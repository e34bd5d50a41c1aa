#!/usr/bin/env bash
# The GPU evaluation benchmark as one prepared run on the device machine: a
# Qwen3.6-27B-shaped random drafter (bf16, autocast) on a synthetic 64 x 2,048-token cache (completions
# planted to follow the drafter for 0-7 tokens per cycle), timed in
# the callback's three profiles (greedy only; callback default: stride = block size, the largest
# budget; full: stride 1, budgets 16,32,64) with extra GPU memory and achieved TFLOP/s.
# Figures go to $OUT (or ./gpu_out). PRESET / DEVICE / extra arguments make a tiny CPU check:
#   PRESET=cpu-tiny DEVICE=cpu bash benchmarks/gpu_eval.sh --samples 2 --tokens 96 --dtype bfloat16
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
PRESET=${PRESET:-qwen36-27b}
DEVICE=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/nvidia_smi.txt"
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
CACHE_DIR=$(mktemp -d /tmp/bench_gpu.XXXXXX)
python3 benchmarks/eval.py --preset "$PRESET" --device "$DEVICE" --profiles \
    --json "$OUT/profiles.json" --cache-dir "$CACHE_DIR" "$@" 2>&1 | tee "$OUT/log_profiles.txt"
rc=${PIPESTATUS[0]}
rm -rf "$CACHE_DIR"
exit "$rc"
