#!/usr/bin/env bash
# What a session with a lent GPU runs (one call of the device tool, from the repository root):
#   bash tools/gpu_session.sh
# Builds the CUDA extension against the machine's torch (no network there: nothing is downloaded),
# runs the whole test suite (the CUDA tests run instead of skipping) and the benchmarks, and copies
# logs and results to $OUT (or benchmarks/results/ when OUT is unset).
set -uo pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
start=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -20 | tee "$OUT/build.log"
echo "build: $(( $(date +%s) - start )) s" | tee -a "$OUT/build.log"
python3 -m pytest -q -p no:cacheprovider -x tests 2>&1 | tail -40 | tee "$OUT/tests.log"
python3 benchmarks/bench_checkpoint.py --out "$OUT" 2>&1 | tail -40 | tee "$OUT/bench.log"
