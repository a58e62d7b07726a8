#!/usr/bin/env bash
# Sourced first by every command on the GPU machine (device tool), from the repository root:
#   . bench/device/device_check.sh; <tests and benchmarks>
# Installs the carried wheel folders (.whl-kvikio: kvikio + small deps, always; .whl-nixl: NIXL;
# .whl-sglang: sglang's import chain, see bench/device/fetch_sglang_wheels.sh; the device tool carries
# at most 64 MiB a call, so nixl and sglang travel in different calls) and gdskv itself.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# Into the machine's own python (a throwaway machine), as a user would install them: a subprocess
# with a clean environment then finds them too.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  $(ls -d .whl-*/*.whl) >/tmp/pip.log 2>&1 || { cat /tmp/pip.log; echo "wheel install failed"; exit 1; }
# gdskv itself is installed editable into the machine's python, as CI installs it: kernels/ is
# importable only as gdskv.kernels, through the package-dir mapping the install applies
# (setuptools is on the machine).
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/pip-gdskv.log 2>&1 \
  || { cat /tmp/pip-gdskv.log; echo "gdskv install failed"; exit 1; }
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import kvikio, kvikio.defaults; print('kvikio', kvikio.__version__, 'compat preferred:', kvikio.defaults.is_compat_mode_preferred())"
