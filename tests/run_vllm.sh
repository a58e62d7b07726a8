#!/usr/bin/env bash
# The vLLM adapter tests in their own venv (.venv-vllm): vllm 0.33.0 installed --no-deps plus
# what its offloading import chain needs (tests/requirements-vllm.txt, torch 2.14.1). About
# 3.5 minutes and 6.6 GB from scratch; re-runs reuse the venv while the requirements file and
# the scripts are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash tests/run_engine.sh .venv-vllm tests/requirements-vllm.txt vllm==0.33.0 \
  tests/run_vllm.sh -- tests/test_vllm_spec.py tests/test_vllm_tier.py tests/test_vllm_blocks.py \
  tests/test_failed_read_vllm.py "$@"
