#!/usr/bin/env bash
# gdskv against SGLang's HiCacheFile on the GPU machine, in one call: for each place (the disk,
# /dev/shm) and geometry, `gdskv-bench --compare` runs gdskv (kvikio), raw kvikio and the real
# HiCacheFile class on the same pages, back to back, with the page cache dropped before reads.
# Needs sglang importable (carry .whl-sglang; see bench/device/fetch_sglang_wheels.sh). NIXL is not
# needed here (the device tool cannot carry both wheel sets in one call).
#
#   OUT=/path/to/out bash bench/device/device_hicache.sh   # the summary table comes last
# Env: OUT, DISK_DIR (/var/tmp/gdskv-bench), SHM_DIR, SIZE (1G), BS (64M), IODEPTH (1),
#      GEOMETRIES ("llama3-8b:16 llama3-8b:64 deepseek-v3:64"), PLACES ("disk shm").
set -u
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/bench-results}
DISK_DIR=${DISK_DIR:-/var/tmp/gdskv-bench}
SHM_DIR=${SHM_DIR:-/dev/shm/gdskv-bench}
SIZE=${SIZE:-1G} BS=${BS:-64M} IODEPTH=${IODEPTH:-1}
GEOMETRIES=${GEOMETRIES:-llama3-8b:16 llama3-8b:64 deepseek-v3:64}
PLACES=${PLACES:-disk shm}
$PY -c 'import sglang.srt.mem_cache.hicache_storage' || { echo "sglang does not import"; exit 1; }
mkdir -p "$DISK_DIR" "$SHM_DIR"
for label in $PLACES; do
  if [ "$label" = disk ]; then dir=$DISK_DIR; else dir=$SHM_DIR; fi
  mkdir -p "$OUT/$label"
  for geo in $GEOMETRIES; do
    model=${geo%%:*} pages=${geo#*:} name=${geo%%:*}-p${geo#*:}
    echo "== $label $name (bs=$BS iodepth=$IODEPTH)"
    $PY -m gdskv.bench.cli --name="$name" --model="$model" --page-tokens="$pages" --size="$SIZE" \
      --bs="$BS" --iodepth="$IODEPTH" --rw=write --verify=crc32c --drop_caches --mem=gpu \
      --directory="$dir" --unlink=1 --backend=kvikio --compare --output-format=json --output="$OUT/$label/$name.json" \
      || echo "  failed (its error is above)"
  done
  rm -rf "$dir"/gdskv-bench-* 2>/dev/null
done
$PY "$HERE/summary_table.py" "$OUT" | tee "$OUT/summary.md"
