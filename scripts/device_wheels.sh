#!/usr/bin/env bash
# Wheels of the dependencies a GPU machine without internet lacks (the device tool's image has
# Python 3.12, torch 2.11, lightning, numpy, scipy, matplotlib, rich, tensorboard), into .whl/
# for `carry`. Run here, once per change of dependencies, from the repository root, with the
# project's environment active (`pip install -e .`): each wheel is the version pip resolved
# for the project there, so the GPU machine runs what the tests ran.
#   scripts/device_wheels.sh
# scripts/gpu_measurements.sh installs them on the GPU machine.
set -euo pipefail
PY=${PYTHON:-python3}
# the packages the image lacks, each with the version installed here
NEEDED="hydra-core omegaconf antlr4-python3-runtime pytorch-optimizer espeakng-loader soundfile cffi pycparser safetensors"
pins=$("$PY" - $NEEDED <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
missing, pins = [], []
for name in sys.argv[1:]:
    try:
        pins.append(f"{name}=={version(name)}")
    except PackageNotFoundError:
        missing.append(name)
if missing:
    sys.exit(f"device_wheels.sh: {', '.join(missing)} not installed in this environment; "
             "activate the project's venv (pip install -e .) first")
print(" ".join(pins))
PY
)
rm -rf .whl && mkdir -p .whl  # one version of each: a second one stops the install there
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
binary=() source_only=()
for pin in $pins; do
  # antlr4-python3-runtime (hydra's parser) is published as a source archive only: built here
  case $pin in antlr4-python3-runtime==*) source_only+=("$pin") ;; *) binary+=("$pin") ;; esac
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]/#/--platform=}" -d .whl "${binary[@]}"
"$PY" -m pip wheel -q --no-deps -w .whl "${source_only[@]}"
echo "wheels in .whl ($(du -sh .whl | cut -f1)): $pins"
