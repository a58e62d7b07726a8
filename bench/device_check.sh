#!/usr/bin/env bash
# Runs on the GPU machine (device tool), from the repository root, with .whl carried:
# installs the carried wheels, runs the whole test suite on CUDA (nothing GPU-related skipped),
# sourced first by every device command: `. bench/device_check.sh; <tests and benchmarks>`
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl >/tmp/pip.log 2>&1 || { cat /tmp/pip.log; echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import kvikio, kvikio.defaults; print('kvikio', kvikio.__version__, 'compat preferred:', kvikio.defaults.is_compat_mode_preferred())"
