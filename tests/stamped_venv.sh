#!/usr/bin/env bash
# Build an engine's test venv once: `stamped_venv.sh VENV REQUIREMENTS PACKAGE==VERSION`
# installs REQUIREMENTS, then PACKAGE with --no-deps (engines' full dependency lists pull GPU
# kernels their storage interfaces do not need), and records the requirements file's hash in
# the venv. A later call reuses the venv while that hash is unchanged.
set -euo pipefail
venv=$1 requirements=$2 package=$3
stamp="$venv/.requirements.sha256"
want=$(sha256sum "$requirements" | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  python3 -m venv --clear "$venv"
  "$venv/bin/pip" install -q -r "$requirements"
  "$venv/bin/pip" install -q --no-deps "$package"
  echo "$want" > "$stamp"
fi
