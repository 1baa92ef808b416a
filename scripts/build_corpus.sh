#!/usr/bin/env bash
# Build the built-in eSpeak corpus (default size) and a held-out companion into OUT.
#   scripts/build_corpus.sh OUT [extra args for python -m speechattn.data.synth]
set -euo pipefail
OUT=${1:?usage: scripts/build_corpus.sh OUT [--speakers N --utterances-per-speaker M --seed S]}
shift
python -m speechattn.data.synth --out "$OUT/main" "$@"
python -m speechattn.data.synth --out "$OUT/heldout" --heldout "$@"
