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
# about 4-6 minutes on an H100/H200 VM disk at 1-3 GB/s. Lower SIZE for a quicker pass.
#
# Usage (repo root; the caller sets PYTHONPATH so gdskv, kvikio and nixl import):
#   OUT=/path/to/out bash bench/device_results.sh
# Env: OUT (default ./bench-results), DISK_DIR (default /var/tmp/gdskv-bench), SIZE (1G),
#      BS (64M), IODEPTH (1), MEM (gpu when CUDA works, else host), SWEEP_BS (2M,8M,32M,128M), SKIP_SHM=1.
set -u
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/bench-results}
DISK_DIR=${DISK_DIR:-/var/tmp/gdskv-bench}
SHM_DIR=${SHM_DIR:-/dev/shm/gdskv-bench}
export SIZE=${SIZE:-1G} BS=${BS:-64M} IODEPTH=${IODEPTH:-1}
SWEEP_BS=${SWEEP_BS:-2M,8M,32M,128M}
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

places="disk:$DISK_DIR"
[ "${SKIP_SHM:-0}" = 1 ] || { mkdir -p "$SHM_DIR" && places="$places shm:$SHM_DIR"; }

for place in $places; do
  label=${place%%:*}; export DIR=${place#*:}
  mkdir -p "$OUT/$label"
  echo "== $label ($DIR): dd"
  $PY -m gdskv.bench.ddbase --directory "$DIR" --size "$SIZE" --bs "$BS" --json "$OUT/$label/dd.json"
  for geo in llama3-8b:16 llama3-8b:64 deepseek-v3:64; do
    export MODEL=${geo%%:*} PAGES=${geo#*:}
    name="$MODEL-p$PAGES"
    echo "== $label $name: gdskv/raw x kvikio/nixl/posix (t=$(( $(date +%s) - START ))s)"
    $BENCH "$HERE/jobs/device.ini" --output-format=json --output="$OUT/$label/$name.json" \
      2> >(tee "$OUT/$label/$name.err" >&2)
    if [ $HICACHE = 1 ]; then
      $BENCH "$HERE/jobs/device-hicache.ini" --output-format=json \
        --output="$OUT/$label/$name-hicache.json" 2> >(tee -a "$OUT/$label/$name.err" >&2)
    fi
  done
  rm -rf "$DIR"/gdskv-bench-* 2>/dev/null
done
rmdir "$SHM_DIR" 2>/dev/null

echo "== sweep bs=$SWEEP_BS on disk (llama3-8b, 16-token pages; gdskv vs raw, default backend)"
$BENCH --name=sweep --model=llama3-8b --page-tokens=16 --size="$SIZE" --rw=write --verify=1 \
  --mem="$MEM" --directory="$DISK_DIR" --compare --sweep=bs="$SWEEP_BS" \
  --sweep-dir="$OUT/sweep" --output-format=normal > "$OUT/sweep/sweep.txt" 2>&1 \
  || echo "sweep: exit $? (see $OUT/sweep/sweep.txt)"
tail -n 12 "$OUT/sweep/sweep.txt" 2>/dev/null

echo "== summary (GB/s of KV payload; w/raw etc. are ratios; $(( $(date +%s) - START ))s total)"
$PY -m gdskv.bench.summary "$OUT" | tee "$OUT/summary.md"
