#!/usr/bin/env bash
# Sourced first by every command on the GPU machine (device tool), from the repository root:
#   . bench/device/device_check.sh; <tests and benchmarks>
# Installs the carried wheel folders (.whl-kvikio: kvikio + small deps, always; .whl-nixl: NIXL;
# .whl-sglang: sglang's import chain, see bench/device/fetch_sglang_wheels.sh; the device tool carries
# at most 64 MiB a call, so nixl and sglang travel in different calls) and sets PYTHONPATH.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls -d .whl-*/*.whl) >/tmp/pip.log 2>&1 || { cat /tmp/pip.log; echo "wheel install failed"; exit 1; }
# gdskv itself is installed (not put on PYTHONPATH): kernels/ is importable only as gdskv.kernels,
# through the package-dir mapping an install applies (setuptools is on the machine). PYTHONSAFEPATH
# keeps `python3 -m ...` from putting the tree's own gdskv/ (no kernels there) ahead of it.
PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
  --no-cache-dir --upgrade --target /tmp/site . >/tmp/pip-gdskv.log 2>&1 \
  || { cat /tmp/pip-gdskv.log; echo "gdskv install failed"; exit 1; }
rm -rf build gdskv.egg-info
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import kvikio, kvikio.defaults; print('kvikio', kvikio.__version__, 'compat preferred:', kvikio.defaults.is_compat_mode_preferred())"
