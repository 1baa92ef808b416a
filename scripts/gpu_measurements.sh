#!/usr/bin/env bash
# GPU measurements for a session lent a GPU machine (docs/gpu.md). Build the wheels here once
# (scripts/device_wheels.sh), carry .whl, and run on the GPU machine:
#   scripts/gpu_measurements.sh lease      # THE one command for a 15-minute lease: at most
#                                          # ~7 min on one H100, wheel install included: the
#                                          # machine, every variant's training step at the
#                                          # paper's shapes (ms/step, vs full, MFU, memory,
#                                          # syncs, attention kernel), Flex and compiled steps,
#                                          # a 30-step Lightning run; -> $OUT/lease.jsonl, lease.md
#   scripts/gpu_measurements.sh lease --device cpu --tiny   # the same harness on a CPU (CI)
#   scripts/gpu_measurements.sh suite      # pytest -m gpu (longer leases: about 10 min)
#   scripts/gpu_measurements.sh attention  # bench attention --device cuda, T = 128 .. 16384
#   scripts/gpu_measurements.sh pretrain   # bench pretrain --device cuda, paper shapes
# Extra arguments after the mode go to its command (lease: `python -m speechattn.bench lease -h`).
# Results go to $OUT (the device tool's output folder; ./gpu_results elsewhere).
set -euo pipefail
export SPEECHATTN_LEASE_T0=${SPEECHATTN_LEASE_T0:-$(date +%s)}  # the lease's clock starts here
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
mode=${1:-}
shift || true
export PYTHONUNBUFFERED=1

# The packages the GPU image lacks travel as wheels (.whl, scripts/device_wheels.sh).
check="import hydra, omegaconf, pytorch_optimizer, soundfile, espeakng_loader, safetensors"
if ! python3 -c "$check" 2>/dev/null; then
  if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "gpu_measurements.sh: hydra, omegaconf, pytorch_optimizer, soundfile, espeakng_loader or safetensors" \
      "is missing and no wheels were carried: run scripts/device_wheels.sh on the development" \
      "machine and carry .whl" >&2
    exit 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
  python3 -c "$check" || { echo "gpu_measurements.sh: the carried wheels did not install" >&2; exit 1; }
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
fi

case "$mode" in
  lease)
    # a case that takes the process down is recorded as crashed; the rerun skips what is done
    for attempt in 1 2 3; do
      extra=(); [ "$attempt" -gt 1 ] && extra=(--resume)
      if python3 -m speechattn.bench lease --out "$OUT" "${extra[@]}" "$@" 2>&1 | tee -a "$OUT/lease.log"; then
        exit 0
      fi
      echo "gpu_measurements.sh: the lease run stopped (attempt $attempt); resuming" | tee -a "$OUT/lease.log"
    done
    exit 1 ;;
  suite)
    python3 -m pytest -m gpu -q -p no:cacheprovider tests "$@" 2>&1 | tee "$OUT/gpu_suite.log" ;;
  attention)
    python3 -m speechattn.bench attention --device cuda --reps 5 --json "$OUT/bench_attention.json" \
      --lengths 128 256 512 1024 2048 4096 8192 16384 "$@" 2>&1 | tee "$OUT/bench_attention.log" ;;
  pretrain)
    python3 -m speechattn.bench pretrain --device cuda --model aalbert_base --batch 50 \
      --frames 500 --attention all --json "$OUT/bench_pretrain.json" "$@" 2>&1 | tee "$OUT/bench_pretrain.log" ;;
  *)
    echo "usage: $0 lease|suite|attention|pretrain [ARGS...]" >&2; exit 2 ;;
esac
