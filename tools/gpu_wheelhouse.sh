#!/usr/bin/env bash
# The wheels tools/gpu_check.py needs on a lent GPU machine and its image lacks (Python 3.12, torch
# 2.11, no torchao, no torchdata; nothing reachable from there), into .whl/ (ignored by git; the
# device call carries it with the working tree, 64 MiB at most). torchao 0.18.0 is the first
# release built for torch 2.11; torchdata 0.11.0 is pure Python. docs/gpu-results.md has the call.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl torchao==0.18.0 torchdata==0.11.0
size=$(du -sm .whl | cut -f1)
ls -l .whl
echo "wheelhouse .whl: ${size} MiB (the device call carries 64 MiB at most, the working tree included)"
[ "$size" -lt 48 ] || { echo "gpu_wheelhouse: .whl is ${size} MiB: too large to carry beside the tree" >&2; exit 1; }
