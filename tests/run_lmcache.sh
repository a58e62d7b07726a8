#!/usr/bin/env bash
# gdskv's LMCache L2 adapter against the real lmcache package, in its own venv (.venv-lmcache,
# tests/requirements-lmcache.txt): the adapter tests, then LMCache's own `lmcache bench l2` on
# the adapter at a small size with its round-trip check on (test_lmcache_bench_l2_verifies_round_trip).
# About 4 minutes and 1.9 GB from scratch; re-runs reuse the venv while the requirements file
# and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
. tests/venv.sh
venv=.venv-lmcache
if venv_stale "$venv" tests/requirements-lmcache.txt tests/run_lmcache.sh; then
  "$venv/bin/pip" install -q -r tests/requirements-lmcache.txt
  venv_built "$venv"
fi
"$venv/bin/pip" install -q --no-deps -e .
LMCACHE_DISABLE_BANNER=1 "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider \
  -W ignore::DeprecationWarning -W ignore::FutureWarning tests/test_lmcache_adapter.py \
  tests/test_byte_pages.py "$@"
