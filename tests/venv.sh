# Sourced by the tests/run*.sh scripts: build a venv only when what it is built from changed.
#
#   if venv_stale VENV FILE...; then <install into VENV>; venv_built VENV; fi
#
# venv_stale recreates VENV empty and returns 0 when VENV is missing or the sha256 of FILE...
# differs from the one stamped at its last complete build; else returns 1 and VENV is reused.
# The stamp is written only by venv_built, after the installs succeeded, so an interrupted build
# is redone. A fresh clone (CI) has no venv and always builds from scratch.
venv_stale() {
  local venv=$1; shift
  local want; want=$(cat "$@" | sha256sum | cut -d' ' -f1)
  if [ -f "$venv/.inputs.sha256" ] && [ "$(cat "$venv/.inputs.sha256")" = "$want" ]; then
    echo "reusing $venv (its inputs $* are unchanged; delete it to rebuild)"
    return 1
  fi
  echo "building $venv from $*"
  python3 -m venv --clear "$venv"
  echo "$want" > "$venv/.inputs.pending"
}

venv_built() {
  mv "$1/.inputs.pending" "$1/.inputs.sha256"
}
