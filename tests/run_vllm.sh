#!/usr/bin/env bash
# The vLLM adapter tests in their own venv (.venv-vllm): vllm 0.33.0 installed --no-deps plus
# what its offloading import chain needs (tests/requirements-vllm.txt, torch 2.14.1). About
# 3.5 minutes and 6.6 GB from scratch; re-runs reuse the venv while the requirements file and
# this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
. tests/venv.sh
venv=.venv-vllm
if venv_stale "$venv" tests/requirements-vllm.txt tests/run_vllm.sh; then
  "$venv/bin/pip" install -q -r tests/requirements-vllm.txt
  "$venv/bin/pip" install -q --no-deps vllm==0.33.0
  venv_built "$venv"
fi
"$venv/bin/pip" install -q --no-deps -e .
"$venv/bin/python" -m pytest -q -rs tests/test_vllm_spec.py tests/test_vllm_tier.py \
  tests/test_vllm_blocks.py "$@"
