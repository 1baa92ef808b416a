#!/usr/bin/env bash
# Reproduce the attention study (docs/tiny_study.md): pretrain every attention variant, evaluate each on
# the four downstream tasks plus the mel baseline, benchmark, and write the report.
#
#   recipes/attention_study.sh tiny [OUT]                 # built-in corpus, CPU (< 90 min on 2 cores)
#   recipes/attention_study.sh paper [OUT] [LIBRISPEECH]  # LibriSpeech (or $LIBRISPEECH), GPU
#
# Extra options go to recipes/attention_study.py after `--`, e.g.
#   recipes/attention_study.sh tiny results/tiny -- --variants full,ldsa --tasks phone_1hidden
#   recipes/attention_study.sh paper OUT ROOT -- --launcher slurm --launcher-arg hydra.launcher.partition=gpu
# Rerunning the same command resumes: finished pretrainings and results are skipped.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
scale="${1:-tiny}"
case "$scale" in
  tiny|paper) ;;
  -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
  *) echo "usage: $0 tiny|paper [OUT] [LIBRISPEECH] [-- options]" >&2; exit 2 ;;
esac
shift || true
out="results/$scale"
if [[ $# -gt 0 && "$1" != "--" ]]; then out="$1"; shift; fi
librispeech="${LIBRISPEECH:-}"
if [[ $# -gt 0 && "$1" != "--" ]]; then librispeech="$1"; shift; fi
if [[ $# -gt 0 && "$1" == "--" ]]; then shift; fi
args=(--scale "$scale" --out "$out")
if [[ -n "$librispeech" ]]; then args+=(--librispeech "$librispeech"); fi
exec "${PYTHON:-python}" "$here/attention_study.py" "${args[@]}" "$@"
