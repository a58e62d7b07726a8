#!/usr/bin/env bash
# The vLLM adapter tests in their own venv (.venv-vllm): vllm 0.33.0 installed --no-deps plus
# what its offloading import chain needs (tests/requirements-vllm.txt, torch 2.14.1). About
# 4 minutes and 6.6 GB from scratch; re-runs reuse the venv while the requirements file is
# unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-vllm
stamp="$venv/.requirements-vllm.sha256"
want=$(sha256sum tests/requirements-vllm.txt | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  python3 -m venv --clear "$venv"
  "$venv/bin/pip" install -q -r tests/requirements-vllm.txt
  "$venv/bin/pip" install -q --no-deps vllm==0.33.0
  echo "$want" > "$stamp"
fi
"$venv/bin/pip" install -q --no-deps -e .
"$venv/bin/python" -m pytest -q tests/test_vllm_spec.py tests/test_vllm_tier.py "$@"
