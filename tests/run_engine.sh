#!/usr/bin/env bash
# An engine adapter's tests in the engine's own venv, built only when its inputs changed:
#   run_engine.sh VENV REQUIREMENTS PACKAGE==VERSION CALLER_SCRIPT -- PYTEST_ARGS...
# installs REQUIREMENTS, then the engine PACKAGE with --no-deps (its full dependency list pulls
# GPU kernels and serving stacks the adapter's interfaces do not need), then gdskv editable, and
# runs pytest. The venv is rebuilt when REQUIREMENTS, CALLER_SCRIPT or this script change.
set -euo pipefail
cd "$(dirname "$0")/.."
. tests/venv.sh
venv=$1 requirements=$2 package=$3 caller=$4
shift 4
[ "${1:-}" = "--" ] && shift
if venv_stale "$venv" "$requirements" "$caller" tests/run_engine.sh; then
  "$venv/bin/pip" install -q -r "$requirements"
  "$venv/bin/pip" install -q --no-deps "$package"
  venv_built "$venv"
fi
"$venv/bin/pip" install -q --no-deps -e .
"$venv/bin/python" -m pytest -q -rs "$@"
