#!/usr/bin/env bash
# One call on one H200: the LM head + loss variants alone, then the whole step at the paper shape (fused loss by
# default, the plain loss and the other variants beside it). Results under $1 (default bench/results).
set -uo pipefail
out="${1:-bench/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 bench/lm_head_loss.py --out "$out/h200-lm-head-loss.json" 2>&1 | tail -20
python3 bench/h200_perf.py --skip-cli --skip-isolated --steady-steps 40 --out "$out/h200-step-round3.json" 2>&1 \
  | grep -v "^\[" | tail -45
