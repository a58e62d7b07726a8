#!/usr/bin/env bash
# The page engine's tests under AddressSanitizer and UndefinedBehaviorSanitizer.
#
# Builds gdskv/native/_pages.c (with quick_read.c, trailer.c and records.c) and _locks.c with -fsanitize=address,undefined into a copy of
# this tree's tracked files (the checkout's own build is left alone), then runs the engine's
# tests, the lock's and the data-path tests that go through them from that copy, with the ASan
# runtime preloaded (python itself is not instrumented). Any report stops the run
# (halt_on_error) and fails the script.
# Leak checking is off: CPython and torch keep memory until exit by design.
#
#   bash tests/sanitize_native.sh [PYTHON] [-- PYTEST_ARGS...]    (PYTHON: default python3)
#
# Its output, packed: bench/results/cpu-2026-11-28/native-sanitizer-5/ (with the tests' stores on
# /dev/shm too, where slab files are read from their mappings: -- --basetemp=/dev/shm/DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
py=python3
if [ $# -gt 0 ] && [ "$1" != "--" ]; then py=$1; shift; fi
[ "${1:-}" = "--" ] && shift
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git ls-files -z | xargs -0 cp --parents -t "$tmp"
inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
limited=$("$py" -c 'import sys; print("-DPy_LIMITED_API=0x030B0000" if sys.version_info >= (3, 11) else "")')
suffix=$("$py" -c 'import sys, sysconfig; print(".abi3.so" if sys.version_info >= (3, 11) else sysconfig.get_config_var("EXT_SUFFIX"))')
cc=${CC:-gcc}
flags=(-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
       -O1 -g -shared -fPIC -Wall -Wextra -Wno-unused-parameter -Werror)
# the page engine (with its quick reader, slot trailers and journal records) and the data path's yielding lock
for sources in "_pages quick_read trailer records" "_locks"; do
  read -r ext more <<<"$sources"
  srcs=("$tmp/gdskv/native/$ext.c")
  for c in ${more:-}; do srcs+=("$tmp/gdskv/native/$c.c"); done
  echo "+ $cc ${flags[*]} $limited -I$inc ${srcs[*]#$tmp/} -o gdskv/native/$ext$suffix"
  $cc "${flags[@]}" $limited -I"$inc" "${srcs[@]}" -o "$tmp/gdskv/native/$ext$suffix"
done
asan=$($cc -print-file-name=libasan.so)
echo "+ ASan runtime: $asan; $($cc --version | head -1); $("$py" -V)"
cd "$tmp"
export LD_PRELOAD=$asan PYTHONPATH=$tmp PYTHONDONTWRITEBYTECODE=1
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:alloc_dealloc_mismatch=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
"$py" -c 'import gdskv.native as n; assert n.NATIVE is not None, n.LOAD_ERROR; print("+ engine:", n._pages.__file__, n.NATIVE.checksum)'
"$py" -c 'import gdskv.native._locks as m; print("+ lock:", m.__file__)'
files=(tests/test_native.py tests/test_host_pages.py tests/test_io_on_caller.py
       tests/test_corruption.py tests/test_byte_pages.py tests/test_quick_calls.py
       tests/test_yielding_lock.py tests/test_concurrency.py tests/test_call_gate.py
       tests/test_store_safety.py tests/test_resources.py tests/test_memory_files.py
       tests/test_put_acknowledgement.py tests/test_journal_records.py tests/test_call_combiner.py)
echo "+ pytest ${files[*]} $*"
"$py" -m pytest -q -p no:cacheprovider -m "not slow and not gpu" "${files[@]}" "$@"
echo "+ sanitizers: no report"
