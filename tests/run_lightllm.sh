#!/usr/bin/env bash
# The LightLLM adapter tests in their own venv (.venv-lightllm): torch 2.13.0 CPU and the small
# packages LightLLM's cache code imports (tests/requirements-lightllm.txt), LightLLM main 87881ae
# installed --no-deps from ../shared/upstream (LightLLM is not on the package index), gdskv and
# the opt-in light_mem module (integrations/light_mem). Re-runs reuse the venv while the
# requirements file and this script are unchanged. Where the LightLLM tarball is absent (a clone
# without ../shared/upstream), the tests are skipped with that reason.
set -euo pipefail
cd "$(dirname "$0")/.."
lightllm=../shared/upstream/lightllm-87881ae.tar.gz
if [ ! -f "$lightllm" ]; then
  echo "SKIPPED tests/test_lightllm_adapter.py: $lightllm is absent (LightLLM is not on the" \
       "package index; see docs/lightllm.md)"
  exit 0
fi
. tests/venv.sh
venv=.venv-lightllm
if venv_stale "$venv" tests/requirements-lightllm.txt tests/run_lightllm.sh; then
  "$venv/bin/pip" install -q -r tests/requirements-lightllm.txt
  "$venv/bin/pip" install -q --no-deps "$lightllm"
  venv_built "$venv"
fi
"$venv/bin/pip" install -q --no-deps -e . -e integrations/light_mem
"$venv/bin/python" -m pytest -q -rs tests/test_lightllm_adapter.py "$@"
