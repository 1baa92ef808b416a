#!/usr/bin/env bash
# The GPU measurements of issue 12, for a session lent the device. Each part fits one
# 10-minute device call and writes its log and JSON under $OUT (the device tool's output
# folder; ./gpu_results elsewhere). Carry .whl (scripts/device_wheels.sh) and run, e.g.
#   scripts/gpu_measurements.sh suite      # pytest -m gpu: kernels, 30-step pretraining per
#                                          # family, resume, DDP, both benchmarks' MFU
#   scripts/gpu_measurements.sh attention  # bench attention --device cuda, T = 128 .. 16384
#   scripts/gpu_measurements.sh pretrain   # bench pretrain --device cuda, aalbert_base,
#                                          # batch 50 x 500 frames, every variant
#   scripts/gpu_measurements.sh paper [full,ldsa,...]  # experiment=paper on the built-in corpus,
#                                          # 300 steps each: frames/s and data_wait
set -euo pipefail
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"

case "${1:-}" in
  suite)
    python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_suite.log" ;;
  attention)
    python3 -m speechattn.bench attention --device cuda --reps 5 --json "$OUT/bench_attention.json" \
      --lengths 128 256 512 1024 2048 4096 8192 16384 2>&1 | tee "$OUT/bench_attention.log" ;;
  pretrain)
    python3 -m speechattn.bench pretrain --device cuda --model aalbert_base --batch 50 \
      --frames 500 --attention all --json "$OUT/bench_pretrain.json" 2>&1 | tee "$OUT/bench_pretrain.log" ;;
  paper)
    for variant in $(echo "${2:-full,ldsa,syn_fixed}" | tr , ' '); do
      python3 -m speechattn.pretrain experiment=paper data=embedded attention="$variant" \
        trainer.max_steps=300 trainer.log_every_n_steps=10 trainer.val_check_interval=300 \
        checkpoint.every_n_steps=300 progress_bar=none hydra.run.dir="/tmp/paper/$variant" \
        2>&1 | tail -5 | tee "$OUT/paper_$variant.log"
      cp "/tmp/paper/$variant/metrics.csv" "$OUT/paper_${variant}_metrics.csv"
    done ;;
  *)
    echo "usage: $0 suite | attention | pretrain | paper [VARIANTS]" >&2; exit 2 ;;
esac
