#!/usr/bin/env bash
# Packs a run folder's raw output (per-call logs and text dumps: *.txt, *.log) into one
# compressed archive, raw.tar.xz, beside the README and the JSON that bench/RESULTS.md cites.
# Run it on each new run folder before committing it: bench/results/ has a size budget
# (tests/test_repo_budget.py). Members keep their paths relative to the run folder, so
# `tar -xJf raw.tar.xz` in the folder puts every file back where the README says it is.
#   bash bench/device/pack_run.sh bench/results/<machine>-<date>/<run>
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 RUN_FOLDER [RUN_FOLDER ...]" >&2; exit 2; }
for run in "$@"; do
  [ -f "$run/README.md" ] || { echo "$run: not a run folder (no README.md)" >&2; exit 1; }
  ( cd "$run"
    mapfile -t raw < <(find . -type f \( -name '*.txt' -o -name '*.log' \) -printf '%P\n' | sort)
    [ ${#raw[@]} -gt 0 ] || exit 0
    old=()
    if [ -f raw.tar.xz ]; then
      # Re-packing: keep what the archive already holds, add the new files.
      tmp=$(mktemp -d); tar -xJf raw.tar.xz -C "$tmp"
      cp --parents "${raw[@]}" "$tmp"/
      mapfile -t old < <(cd "$tmp" && find . -type f -printf '%P\n' | sort)
      tar --sort=name --owner=0 --group=0 --mtime=2026-01-01 -C "$tmp" -cf - "${old[@]}" | xz -9 > raw.tar.xz.new
      rm -rf "$tmp"
    else
      tar --sort=name --owner=0 --group=0 --mtime=2026-01-01 -cf - "${raw[@]}" | xz -9 > raw.tar.xz.new
    fi
    mv raw.tar.xz.new raw.tar.xz
    rm -f "${raw[@]}"
    find . -mindepth 1 -type d -empty -delete
    echo "$run: packed ${#raw[@]} files into raw.tar.xz ($(stat -c %s raw.tar.xz) bytes)" )
done
