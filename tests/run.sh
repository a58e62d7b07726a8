#!/usr/bin/env bash
# The README's test command: fresh venv, gdskv with its test/gpu/nixl extras, the test suite
# (slow-marked tests excluded), then the SGLang and vLLM adapter tests in their own venvs. Run from
# anywhere; works on a fresh clone.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv --clear .venv
.venv/bin/pip install -q --upgrade pip
# torch 2.13.0 CPU is the wheel this project's machines carry locally; elsewhere pip fetches it.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[test,gpu,nixl]'
.venv/bin/python -m pytest -q -m "not slow" "$@"
# The SGLang adapter against the real sglang package, in its own venv (torch 2.14.1; see there).
bash tests/run_sglang.sh
# The vLLM adapter against the real vllm package, in its own venv (torch 2.14.1; see there).
bash tests/run_vllm.sh
