#!/usr/bin/env bash
# Wheels of the dependencies the GPU machine (device tool: Python 3.12, torch 2.11, lightning,
# no internet) lacks, into .whl/ for `carry`. Run here, once, from the repository root:
#   scripts/device_wheels.sh
# Each device call then carries .whl and starts with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
mkdir -p .whl
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]/#/--platform=}" -d .whl \
  hydra-core==1.3.2 omegaconf==2.3.0 pytorch-optimizer espeakng-loader soundfile cffi pycparser
# antlr4-python3-runtime (hydra's parser) is published as a source archive only: build it here.
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
du -sh .whl
