#!/usr/bin/env bash
# The LightLLM adapter tests in their own venv (.venv-lightllm): torch 2.13.0 CPU and the small
# packages LightLLM's cache code imports (tests/requirements-lightllm.txt), LightLLM main 87881ae
# installed --no-deps from ../shared/upstream (LightLLM is not on the package index; without that
# folder, from its repository at the same commit), gdskv and the opt-in light_mem module
# (integrations/light_mem). About 3.5 minutes and 2.6 GB from scratch; re-runs reuse the venv
# while the requirements file and this script are unchanged. Where neither source of LightLLM
# can be had, the tests are skipped with that reason.
set -euo pipefail
cd "$(dirname "$0")/.."
lightllm=../shared/upstream/lightllm-87881ae.tar.gz
repo=https://github.com/ModelTC/LightLLM
if [ ! -f "$lightllm" ]; then
  if ! timeout 30 git ls-remote "$repo" HEAD >/dev/null 2>&1; then
    echo "SKIPPED tests/test_lightllm_adapter.py tests/test_failed_read_lightllm.py: $lightllm is absent and $repo is not" \
         "reachable (LightLLM is not on the package index; see docs/lightllm.md)"
    exit 0
  fi
  lightllm="lightllm @ git+$repo@87881ae7c"
fi
. tests/venv.sh
venv=.venv-lightllm
if venv_stale "$venv" tests/requirements-lightllm.txt tests/run_lightllm.sh; then
  "$venv/bin/pip" install -q -r tests/requirements-lightllm.txt
  "$venv/bin/pip" install -q --no-deps "$lightllm"
  venv_built "$venv"
fi
"$venv/bin/pip" install -q --no-deps -e . -e integrations/light_mem
"$venv/bin/python" -m pytest -q -rs tests/test_lightllm_adapter.py tests/test_failed_read_lightllm.py "$@"
