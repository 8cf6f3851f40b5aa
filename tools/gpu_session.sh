#!/usr/bin/env bash
# What a session with a lent GPU runs, one device call per step (each call is limited to 10 minutes):
#   bash tools/gpu_session.sh build test        # build the CUDA extension, run the whole suite
#   bash tools/gpu_session.sh build bench       # engine benchmark + fused-layer benchmark
#   bash tools/gpu_session.sh build suite       # python -m ckpt_ext.bench, bert-large, batches 8..64
#   bash tools/gpu_session.sh build suite-max   # the same with --batch max
# Builds against the machine's torch (no network there: nothing is downloaded). Logs and results go
# to $OUT (or benchmarks/results/ when OUT is unset); commit them under benchmarks/results/.
set -uo pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
for step in "$@"; do
  case "$step" in
    build)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
      python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
      start=$(date +%s)
      python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -20 | tee "$OUT/build.log"
      echo "build: $(( $(date +%s) - start )) s" | tee -a "$OUT/build.log" ;;
    test) python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tail -60 | tee "$OUT/tests.log" ;;
    bench)
      python3 benchmarks/bench_checkpoint.py --out "$OUT" 2>&1 | tail -40 | tee "$OUT/bench.log"
      python3 benchmarks/bench_fused.py --help >/dev/null 2>&1 && python3 benchmarks/bench_fused.py --device cuda --out "$OUT" 2>&1 | tail -40 | tee "$OUT/bench_fused.log" ;;
    suite) python3 -m ckpt_ext.bench --model bert-large --batch 8,16,32,64 --no-progress --out "$OUT" 2>&1 | tail -40 | tee "$OUT/suite.log" ;;
    suite-max) python3 -m ckpt_ext.bench --model bert-large --batch max --no-progress --out "$OUT" 2>&1 | tail -40 | tee "$OUT/suite-max.log" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
