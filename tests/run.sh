#!/usr/bin/env bash
# The README's test command: .venv with gdskv and its test/gpu/nixl extras (built once, rebuilt
# when pyproject.toml or this script changes), the test suite (slow-marked tests excluded; -rs
# prints each skip's reason) and its data-path tests again on the page engine's Python path and
# with the stores on /dev/shm, then the SGLang, vLLM, LightLLM and LMCache adapter tests in their own venvs. Run from anywhere; on a fresh clone (CI) every venv is built from scratch.
# To re-run only the tests once the venvs exist:  .venv/bin/python -m pytest -q -rs -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
. tests/venv.sh
if venv_stale .venv pyproject.toml tests/run.sh; then
  .venv/bin/pip install -q --upgrade pip
  # torch 2.13.0 CPU is the wheel this project's machines carry locally; elsewhere pip fetches it.
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e '.[test,gpu,nixl]'
  venv_built .venv
fi
# The editable install compiled the page engine (with its quick reader) and the yielding lock
# (gdskv/native/*.c, *.h) when the venv was built: build them again when a source changed since.
for ext in _pages _locks; do
  so=$(ls gdskv/native/$ext*.so 2>/dev/null | head -1)
  stale=$([ -n "$so" ] && find gdskv/native -name '*.[ch]' -newer "$so" | head -1 || echo none)
  if [ -z "$so" ] || [ -n "$stale" ] || [ setup.py -nt "$so" ]; then
    .venv/bin/pip install -q --no-deps --no-build-isolation -e .
    break
  fi
done
.venv/bin/python -m pytest -q -rs -m "not slow" "$@"
# The data-path tests again on the page engine's Python path, the fallback and the oracle the
# native engine is held to (gdskv/native; the run above used the native engine).
.venv/bin/python -m pytest -q -rs -m "not slow" --data-path python tests/test_native.py \
  tests/test_tier.py tests/test_host_pages.py tests/test_byte_pages.py tests/test_io_on_caller.py \
  tests/test_concurrency.py tests/test_corruption.py tests/test_crash.py tests/test_fault_table.py \
  tests/test_store_safety.py tests/test_follower.py tests/test_metrics.py tests/test_quick_calls.py \
  "$@"
# The data-path tests again with every store on /dev/shm (tmpfs), where the posix backend reads
# slab files from their mappings (copy_pages) instead of preadv; skipped where /dev/shm is not
# a file system held in memory.
if [ "$(stat -f -c %T /dev/shm 2>/dev/null)" = tmpfs ]; then
  shm=$(mktemp -d /dev/shm/gdskv-tests.XXXXXX)
  trap 'rm -rf "$shm"' EXIT
  .venv/bin/python -m pytest -q -rs -m "not slow" --basetemp="$shm/b" tests/test_native.py \
    tests/test_tier.py tests/test_host_pages.py tests/test_byte_pages.py tests/test_io_on_caller.py \
    tests/test_concurrency.py tests/test_corruption.py tests/test_failed_reads.py \
    tests/test_resources.py tests/test_quick_calls.py tests/test_follower.py "$@"
  # (and on the Python path, whose copy_pages is the oracle)
  .venv/bin/python -m pytest -q -rs -m "not slow" --data-path python --basetemp="$shm/p" \
    tests/test_native.py tests/test_host_pages.py tests/test_io_on_caller.py \
    tests/test_corruption.py tests/test_failed_reads.py tests/test_quick_calls.py "$@"
  rm -rf "$shm"
fi
# The SGLang adapter against the real sglang package, in its own venv (torch 2.14.1; see there).
bash tests/run_sglang.sh
# The vLLM adapter against the real vllm package, in its own venv (torch 2.14.1; see there).
bash tests/run_vllm.sh
# gdskv as LightLLM's disk cache, against LightLLM's own cache code, in its own venv (see there).
bash tests/run_lightllm.sh
# The LMCache L2 adapter against the real lmcache package, in its own venv (see there).
bash tests/run_lmcache.sh
