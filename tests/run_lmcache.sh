#!/usr/bin/env bash
# gdskv's LMCache L2 adapter against the real lmcache package, in its own venv (.venv-lmcache,
# tests/requirements-lmcache.txt: lmcache 0.5.6 with its own dependencies beside torch 2.13.0
# CPU): the adapter tests, LMCache's own `lmcache bench l2 --no-skip-verify` on the adapter at a
# small size (test_lmcache_bench_l2_verifies_round_trip), and the tier's byte-page tests. About
# 3.5 minutes and 1.9 GB from scratch; re-runs reuse the venv while the requirements file and
# the scripts are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
export LMCACHE_DISABLE_BANNER=1
exec bash tests/run_engine.sh .venv-lmcache tests/requirements-lmcache.txt lmcache==0.5.6 \
  tests/run_lmcache.sh -- -p no:cacheprovider -W ignore::DeprecationWarning \
  -W ignore::FutureWarning tests/test_lmcache_adapter.py tests/test_byte_pages.py \
  tests/test_failed_read_lmcache.py "$@"
