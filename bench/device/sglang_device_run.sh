#!/usr/bin/env bash
# On the GPU machine, from the repository root, with .whl-sglang carried (bench/device/fetch_sglang_wheels.sh):
#   bash bench/device/sglang_device_run.sh
# Runs the SGLang adapter tests on SGLang's own host pools and the adapter-vs-HiCacheFile bench
# (host pool -> store directory on this machine's disk); results under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site-sglang .whl-sglang/*.whl >/tmp/pip-sglang.log 2>&1 \
  || { cat /tmp/pip-sglang.log; echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site-sglang:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, sglang; print('torch', torch.__version__, 'sglang', sglang.__version__)"
python3 -m pytest -q -p no:cacheprovider tests/test_sglang_adapter.py 2>&1 | tee "$OUT/sglang_adapter_tests.log"
mkdir -p /tmp/sglang-bench
for layout in page_first_direct page_first; do
  python3 bench/experiments/sglang_adapter_bench.py --dir /tmp/sglang-bench --layout "$layout" \
    --pages 256 --drop-caches --out "$OUT/sglang_adapter_${layout}.json" 2>&1 | tail -25
done
python3 bench/experiments/sglang_adapter_bench.py --dir /tmp/sglang-bench --mla --layout page_first_direct \
  --pages 256 --drop-caches --out "$OUT/sglang_adapter_mla.json" 2>&1 | tail -25
