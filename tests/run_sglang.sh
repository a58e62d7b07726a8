#!/usr/bin/env bash
# The SGLang adapter tests in their own venv (.venv-sglang): sglang 0.5.23 installed --no-deps
# plus what its storage/host-pool import chain needs (tests/requirements-sglang.txt; torch 2.14.1
# and torchvision 0.29.1, which SGLang's host pool classes need). About 6.5 minutes and 6 GB from
# scratch; re-runs reuse the venv while the requirements file and the scripts are unchanged.
# tests/sglang_upstream: SGLang's own storage-backend unit tests, run against gdskv (and against
# SGLang's HiCacheFile, the control), each built through SGLang's StorageBackendFactory.
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash tests/run_engine.sh .venv-sglang tests/requirements-sglang.txt sglang==0.5.23 \
  tests/run_sglang.sh -- tests/test_sglang_adapter.py tests/test_sglang_v2.py \
  tests/sglang_upstream/test_hicache_storage_unit.py \
  tests/test_bench_cli.py::test_hicachefile_engine_on_the_real_class \
  tests/test_failed_read_sglang.py "$@"
