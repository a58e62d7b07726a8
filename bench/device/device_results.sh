#!/usr/bin/env bash
# gdskv-bench results on the GPU machine: the figures issue 5 asks for, as JSON under $OUT plus
# a summary table printed last.
#
#   Llama-3-8B with 16- and 64-token pages, DeepSeek-V3 (MLA) with 64-token pages;
#   on the disk (DISK_DIR) and on /dev/shm (RAM: software overhead without the disk);
#   each: dd O_DIRECT ceiling, raw and gdskv per backend (kvikio, nixl, posix), SGLang
#   HiCacheFile when sglang imports; every job writes SIZE of pages, drops the page cache,
#   reads them back (timed) and verifies the bytes. Then a bs sweep (PNG) on the disk.
#
# Budget: SIZE=1G per job (2 GiB moved), 3 geometries x 2 places x 7-8 jobs, plus the sweep:
# about 4-6 minutes on an H100/H200 VM disk at 1-3 GB/s. Lower SIZE for a quicker pass, or run
# one place per call (PLACES=disk, then PLACES=shm SWEEP_PLACE=shm).
#
# Batch size: BS bytes per call, or BATCH_PAGES pages per call whatever the page size
# (BATCH_PAGES=128 is SGLang's STORAGE_BATCH_SIZE, the number of pages HiCache hands its L3
# backend per batch_get/batch_set: 256 MiB for Llama-3-8B 16-token pages, 1 GiB for 64-token).
#
# Usage (repo root; the caller sets PYTHONPATH so gdskv, kvikio and nixl import):
#   OUT=/path/to/out bash bench/device/device_results.sh
# Env: OUT (default ./bench-results), DISK_DIR (default /var/tmp/gdskv-bench), SIZE (1G),
#      BS (64M), BATCH_PAGES (unset: use BS), IODEPTH (1), MEM (gpu when CUDA works, else host),
#      PLACES ("disk shm"), SWEEP_BS (2M,8M,32M,128M; empty: no sweep), SWEEP_PLACE (disk),
#      SWEEP_SIZE (SIZE).
set -u
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/bench-results}
DISK_DIR=${DISK_DIR:-/var/tmp/gdskv-bench}
SHM_DIR=${SHM_DIR:-/dev/shm/gdskv-bench}
export SIZE=${SIZE:-1G} BS=${BS:-64M} IODEPTH=${IODEPTH:-1}
DD_BS=$BS
SWEEP_BS=${SWEEP_BS-2M,8M,32M,128M}
SWEEP_PLACE=${SWEEP_PLACE:-disk} SWEEP_SIZE=${SWEEP_SIZE:-$SIZE}
PLACES=${PLACES:-disk shm}
if [ -z "${MEM:-}" ]; then
  MEM=$($PY -c 'import torch; print("gpu" if torch.cuda.is_available() else "host")' 2>/dev/null || echo host)
fi
export MEM
BENCH="$PY -m gdskv.bench.cli"
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT" "$OUT/sweep" "$DISK_DIR"
START=$(date +%s)

echo "== machine"
{ date -u; uname -r; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
  $PY - <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available())
for m in ("kvikio", "nixl", "nixl_cu13", "sglang"):
    try:
        mod = importlib.import_module(m); print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "NOT importable:", type(e).__name__, str(e)[:120])
PY
  for d in "$DISK_DIR" /dev/shm; do echo "$d: $(stat -f -c %T "$d") $(df -h --output=avail "$d" | tail -1)"; done
} 2>&1 | tee "$OUT/machine.txt"

HICACHE=0
$PY -c 'import sglang.srt.mem_cache.hicache_storage' >/dev/null 2>&1 && HICACHE=1
[ $HICACHE = 1 ] || echo "sglang not importable: hicachefile rows skipped"

places=""
for p in $PLACES; do
  case $p in
    disk) places="$places disk:$DISK_DIR" ;;
    shm) mkdir -p "$SHM_DIR" && places="$places shm:$SHM_DIR" ;;
    *) echo "PLACES: unknown place $p (disk, shm)"; exit 2 ;;
  esac
done

for place in $places; do
  label=${place%%:*}; export DIR=${place#*:}
  mkdir -p "$OUT/$label"
  echo "== $label ($DIR): dd"
  $PY "$HERE/ddbase.py" --directory "$DIR" --size "$SIZE" --bs "$DD_BS" --json "$OUT/$label/dd.json"
  for geo in llama3-8b:16 llama3-8b:64 deepseek-v3:64; do
    export MODEL=${geo%%:*} PAGES=${geo#*:}
    name="$MODEL-p$PAGES"
    if [ -n "${BATCH_PAGES:-}" ]; then
      BS=$($PY -c "from gdskv.bench.presets import get_preset as g; print(g('$MODEL').layout($PAGES).page_bytes * $BATCH_PAGES)")
    fi
    export BS
    echo "== $label $name: gdskv/raw x kvikio/nixl/posix, bs=$BS (t=$(( $(date +%s) - START ))s)"
    $BENCH "$HERE/../jobs/device.ini" --output-format=json --output="$OUT/$label/$name.json"
    if [ $HICACHE = 1 ]; then
      $BENCH "$HERE/../jobs/device-hicache.ini" --output-format=json \
        --output="$OUT/$label/$name-hicache.json"
    fi
  done
  rm -rf "$DIR"/gdskv-bench-* 2>/dev/null
done

if [ -n "$SWEEP_BS" ]; then
  if [ "$SWEEP_PLACE" = shm ]; then sweep_dir=$SHM_DIR; else sweep_dir=$DISK_DIR; fi
  mkdir -p "$sweep_dir"
  echo "== sweep bs=$SWEEP_BS on $SWEEP_PLACE (llama3-8b, 16-token pages; gdskv vs raw, and" \
       "hicachefile when sglang imports; default backend)"
  $BENCH --name=sweep --model=llama3-8b --page-tokens=16 --size="$SWEEP_SIZE" --rw=write \
    --verify=crc32c --drop_caches --mem="$MEM" --directory="$sweep_dir" --unlink=1 --compare --sweep=bs="$SWEEP_BS" \
    --sweep-dir="$OUT/sweep" --output-format=normal > "$OUT/sweep/sweep.txt" 2>&1 \
    || echo "sweep: exit $? (see $OUT/sweep/sweep.txt)"
  tail -n 12 "$OUT/sweep/sweep.txt" 2>/dev/null
  rm -rf "$sweep_dir"/gdskv-bench-* "$sweep_dir"/hicache 2>/dev/null
fi
rmdir "$SHM_DIR" 2>/dev/null

echo "== summary (GB/s of KV payload; w/raw etc. are ratios; $(( $(date +%s) - START ))s total)"
$PY "$HERE/summary_table.py" "$OUT" | tee "$OUT/summary.md"
