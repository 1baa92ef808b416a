#!/usr/bin/env bash
# The GPU measurements of issues 12 and 23, for a session lent the device. Each part fits one
# 10-minute device call and writes its log and JSON under $OUT (the device tool's output
# folder; ./gpu_results elsewhere). Carry .whl (scripts/device_wheels.sh) and run, e.g.
#   scripts/gpu_measurements.sh suite      # pytest -m gpu, all but the two parts below:
#                                          # kernels, 30-step pretraining per family, loader
#                                          # workers, fp32 and bf16 resume, DDP, matmul peak,
#                                          # both benchmarks' MFU
#   scripts/gpu_measurements.sh steps [full,ldsa,...]   # every variant (default all 19; both
#                                          # kernels of the two-kernel ones, Flex where offered)
#                                          # trains 4 bf16 steps at paper shapes (aalbert_base,
#                                          # 50 x 500 frames): syncs/step, launches, runtime
#                                          # syncs and copies -> paper_steps.jsonl (about 30
#                                          # runs: split the variants if a call runs out)
#   scripts/gpu_measurements.sh compile [VARIANTS]      # the same steps, model.compile=true
#   scripts/gpu_measurements.sh peak       # matmul_series: sustained FLOP/s per size, bf16,
#                                          # fp16, fp32 with and without TF32
#   scripts/gpu_measurements.sh plan       # bench pretrain --plan experiment=paper (H100,
#                                          # A100): the projection to compare with the above
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
    python3 -m pytest -m gpu -q -p no:cacheprovider tests -k "not paper_shapes and not compiled" \
      2>&1 | tee "$OUT/gpu_suite.log" ;;
  steps|compile)
    export SPEECHATTN_GPU_RESULTS="$OUT" SPEECHATTN_GPU_VARIANTS="${2:-}"
    test=$([ "$1" = steps ] && echo paper_shapes || echo compiled)
    python3 -m pytest -m gpu -q -p no:cacheprovider -rA tests/tasks/test_gpu_pretrain.py -k "$test" \
      2>&1 | tee "$OUT/gpu_$1.log" ;;
  peak)
    python3 - <<'PY' 2>&1 | tee "$OUT/matmul_peak.log"
import torch
from speechattn.bench.common import device_name, matmul_series
print(device_name("cuda"))
for label, dtype, tf32 in [("bf16", torch.bfloat16, False), ("fp16", torch.float16, False),
                           ("fp32", torch.float32, False), ("tf32", torch.float32, True)]:
    torch.backends.cuda.matmul.allow_tf32 = tf32
    rates = matmul_series(device="cuda", dtype=dtype, seconds=0.5, repeat=3)
    print(label, {n: f"{r / 1e12:.1f} TFLOP/s" for n, r in rates.items()})
PY
    ;;
  plan)
    for gpu in h100 a100; do
      python3 -m speechattn.bench pretrain --plan experiment=paper --gpu "$gpu" \
        --json "$OUT/plan_$gpu.json" 2>&1 | tee "$OUT/plan_$gpu.log"
    done ;;
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
    echo "usage: $0 suite | steps [VARIANTS] | compile [VARIANTS] | peak | plan | attention |" \
      "pretrain | paper [VARIANTS]" >&2; exit 2 ;;
esac
