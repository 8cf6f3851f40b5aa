#!/usr/bin/env bash
# The next session with a lent GPU runs exactly this, in one device call (limit: 10 minutes; give the call
# timeout_s=600 and carry .yardsticks), from a clean checkout with the image's default environment:
#
#   mkdir -p .yardsticks && cp ../shared/gpu/*.py .yardsticks/    # here, before the call
#   pip download liger-kernel --no-deps -d .yardsticks/wheels       # optional: section j's Liger comparison (the
#                                                                   # GPU machine has no network; pure-Python wheels
#                                                                   # there are unpacked onto the commands' path)
#   bash tools/gpu_session.sh report
#
# tools/gpu_report.py: build, the CUDA tests, the yardsticks, profiles, kernel bandwidth, compile, the 16 GiB cap
# and fused LoRA, each section with its own time limit, 9 minutes in all; it writes exactly two files into $OUT,
# summary.md (the open issues' targets, met or short, and each section's result) and gpu-report.tar.gz (every log
# and JSON), both rewritten after each section. `report --dry-run` runs every section on CPU with tiny
# configurations (tests/test_gpu_report.py does). docs/gpu-report.md: the sections, budgets, and how results are
# committed under benchmarks/results/<device>/. `report` takes the whole command line (other steps cannot follow).
#
# The older steps, one or several per call (commit what lands in $OUT under benchmarks/results/<device>/):
#
#   bash tools/gpu_session.sh build test bench
# build + test alone take about 5 minutes
# (build ~50 s for one arch with 16 jobs, the suite ~200 s with pytest -n 8). Steps can also be run one per call:
#   bash tools/gpu_session.sh build test        # build the CUDA extension, run the whole suite
#   bash tools/gpu_session.sh build bench       # the benchmarks (a warm machine skips the unchanged build)
#   bash tools/gpu_session.sh build suite       # benchmarks/suite.py, bert-large, batches 8..64
#   bash tools/gpu_session.sh build suite-max   # the same with --batch max
#   bash tools/gpu_session.sh build pareto      # bench_pareto.py: Llama b4 s2048 bf16, planner vs torch SAC policies
#   bash tools/gpu_session.sh build suite-lora  # peft LoRA (r=16, alpha 32, dropout 0.05), bf16: BERT-large,
#                                               # GPT-2 medium, Llama; peft (+ HF ckpt, + ckpt_ext) vs fuse (+ ckpt)
#   bash tools/gpu_session.sh build yardsticks  # the issues' yardsticks, ../shared/gpu/side_by_side.py (BERT-large
#                                               # b32 bf16 and autocast, GPT-2 b16, Llama b4) and kernel_bandwidth.py.
#   bash tools/gpu_session.sh build yardsticks-new  # side_by_side.py's newer variants: keep-attention (Llama b4
#                                               # bf16: torch-sac, ckpt_ext-keep, fused+keep) and compiled (BERT-large
#                                               # b32 bf16: compile:none, compile:hf-gc, compile:ckpt_ext, compile:fused+ckpt)
#     They live outside the repository: first `mkdir -p .yardsticks && cp ../shared/gpu/*.py .yardsticks/` here
#     (.yardsticks/ is ignored) and name ".yardsticks" in the device call's carry.
#
# build: the image exports CC/CXX/CUDAHOSTCXX=/opt/gcc/bin/..., a wrapper that links libstdc++ statically into
# _C.so (C++ error paths then crash in codecvt; setup.py refuses such a compiler), so the system compilers are
# pinned here. No network there: pip runs with --no-build-isolation --no-deps --no-index against the machine's
# torch. TORCH_CUDA_ARCH_LIST is the GPU's own compute capability (one arch: ~50 s instead of minutes).
# Logs and results go to $OUT (or benchmarks/results/ when OUT is unset). Exit status: non-zero if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
status=0

if [ "${1:-}" = report ]; then  # the whole report, its own orchestration (tools/gpu_report.py --help)
  shift
  exec "$PY" tools/gpu_report.py --python "$PY" "$@"
fi

pin_compilers() {
  echo "image compilers: CC=${CC:-} CXX=${CXX:-} CUDAHOSTCXX=${CUDAHOSTCXX:-}"
  if [ -x /usr/bin/g++ ]; then
    export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
  fi
  echo "using: CC=${CC:-} CXX=${CXX:-} CUDAHOSTCXX=${CUDAHOSTCXX:-}"
}

gpu_arch_list() {
  # "9.0" for an H100/H200; several GPUs of different kinds give "8.0;9.0".
  nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | sort -u | paste -sd';'
}

yardsticks_dir() {  # where side_by_side.py is: $YARDSTICKS, .yardsticks (carried), shared/gpu, ../shared/gpu
  for d in "${YARDSTICKS:-}" .yardsticks shared/gpu ../shared/gpu; do
    if [ -n "$d" ] && [ -f "$d/side_by_side.py" ]; then echo "$d"; return; fi
  done
}

for step in "$@"; do
  start=$(date +%s)
  case "$step" in
    build)
      pin_compilers > "$OUT/build.log" 2>&1; cat "$OUT/build.log"  # not in a pipe: the exports must stay
      nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv | tee "$OUT/gpu.txt"
      "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
      arch=$(gpu_arch_list)
      export TORCH_CUDA_ARCH_LIST=${arch:-${TORCH_CUDA_ARCH_LIST:-8.0;9.0+PTX}}
      echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS" | tee -a "$OUT/build.log"
      "$PY" tools/build.py 2>&1 | tee -a "$OUT/build.log" || status=1
      cp build/build.log "$OUT/build-pip.log" 2>/dev/null ;;
    test)
      # Whole suite, 8 workers; the timeout leaves time for the logs to come back within a 10-minute call.
      timeout 480 "$PY" -m pytest -n 8 -q -p no:cacheprovider -rfE tests > "$OUT/tests.log" 2>&1 || status=1
      tail -40 "$OUT/tests.log" ;;
    bench)
      # The benchmarks under benchmarks/ (results as JSON + Markdown into $OUT; commit them under
      # benchmarks/results/<device>/). bench_fused is the issue-10 table (four models, interleaved rounds).
      "$PY" benchmarks/bench_checkpoint.py --out "$OUT" 2>&1 | tee "$OUT/bench_checkpoint.log" | tail -30 || status=1
      "$PY" benchmarks/bench_ops.py --out "$OUT" 2>&1 | tee "$OUT/bench_ops.log" | tail -40 || status=1
      "$PY" benchmarks/bench_fused.py --rounds 10 --no-progress --out "$OUT" 2>&1 | tee "$OUT/bench_fused.log" | tail -40 || status=1 ;;
    pareto)
      # Issue 33: step time against activation memory, Llama 8 x 2048 s2048 b4 bf16: the planner (plain and fused)
      # swept over budgets against torch's selective-checkpointing policies; pareto.png with the tables.
      timeout 540 "$PY" benchmarks/bench_pareto.py --models llama-gpu --mode bf16 --points 4 --rounds 5 --no-progress \
        --out "$OUT" 2>&1 | tee "$OUT/bench_pareto.log" | tail -30 || status=1 ;;
    suite) "$PY" benchmarks/suite.py --model bert-large --batch 8,16,32,64 --no-progress --out "$OUT" 2>&1 | tee "$OUT/suite.log" | tail -40 || status=1 ;;
    suite-max) "$PY" benchmarks/suite.py --model bert-large --batch max --no-progress --out "$OUT" 2>&1 | tee "$OUT/suite-max.log" | tail -40 || status=1 ;;
    suite-lora)
      # Issue 15: the fused LoRA layer + checkpointing against peft + Hugging Face's checkpointing.
      for spec in "bert-large 8,32" "gpt2-medium 8,16" "llama 2,4"; do
        read -r model batches <<< "$spec"
        "$PY" benchmarks/suite.py --model "$model" --batch "$batches" --mode bf16 --lora --repeat 10 --no-progress --out "$OUT" \
          --variants none,hf-torch-nonreentrant,ckpt_ext,fused,ckpt_ext-fused 2>&1 | tee "$OUT/suite-lora-$model.log" | tail -25 || status=1
      done ;;
    yardsticks)
      dir=$(yardsticks_dir)
      if [ -z "$dir" ]; then
        echo "yardsticks: side_by_side.py not found; copy ../shared/gpu/*.py into .yardsticks/ and carry it"; status=1
      else
        for spec in "bert 32 bf16" "bert 32 autocast" "gpt2 16 bf16" "llama 4 bf16"; do
          read -r model batch mode <<< "$spec"
          env=""; [ "$model" != bert ] && env="MODEL=$model"
          (cd "$dir" && env $env "$PY" side_by_side.py "$batch" "$mode") 2>&1 \
            | tee "$OUT/side_by_side-$model-b$batch-$mode.log" | tail -15 || status=1
        done
        (cd "$dir" && "$PY" kernel_bandwidth.py) 2>&1 | tee "$OUT/kernel_bandwidth.log" | tail -30 || status=1
      fi ;;
    yardsticks-new)
      dir=$(yardsticks_dir)
      if [ -z "$dir" ]; then
        echo "yardsticks-new: side_by_side.py not found; copy ../shared/gpu/*.py into .yardsticks/ and carry it"; status=1
      else
        (cd "$dir" && MODEL=llama ADROP=0 VARIANTS=none,hf-gc,torch-sac,ckpt_ext,ckpt_ext-keep,fused,fused+ckpt,fused+keep \
          "$PY" side_by_side.py 4 bf16) 2>&1 | tee "$OUT/side_by_side-llama-b4-bf16-keep.log" | tail -15 || status=1
        (cd "$dir" && ROUNDS=10 VARIANTS=none,compile:none,compile:hf-gc,compile:ckpt_ext,compile:fused,compile:fused+ckpt \
          "$PY" side_by_side.py 32 bf16) 2>&1 | tee "$OUT/side_by_side-bert-b32-bf16-compile.log" | tail -15 || status=1
      fi ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  echo "gpu_session: $step took $(( $(date +%s) - start )) s (status so far: $status)" | tee -a "$OUT/session.log"
done
exit $status
