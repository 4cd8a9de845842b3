#!/usr/bin/env bash
# Every check that needs a GPU, in one go, for a lent device machine (its python3 has torch,
# rich, matplotlib, nvidia-ml-py, pytest and hypothesis; evendp runs from src/, no install):
#
#   bash benchmarks/gpu_checks.sh
#
# Each part prints its own table; a failing part is reported and the others still run.
# About five minutes on one GPU. Nothing here runs in CI (no GPU there).
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
failed=0
run() {
    echo
    echo "== $*"
    "$@" || { echo "!! failed: $*"; failed=1; }
}
run "$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
run "$PY" -m evendp devices
# The gpu-marked tests: BalancedDataParallel on ["cuda:0", "cuda:0"], fp16 GradScaler.
run "$PY" -m pytest -q -p no:cacheprovider -m gpu tests
run "$PY" benchmarks/overhead.py --device cuda:0
# Planner: predicted against measured max_memory_reserved per model (target within 5%).
run "$PY" benchmarks/planner_gpu.py
# The demo on two virtual devices of one GPU, split 2:1, with its exactness check.
run "$PY" -m evendp train --steps 100 --devices 0,0 --weights 2,1 --out /tmp/evendp-gpu \
    --no-progress
exit "$failed"
