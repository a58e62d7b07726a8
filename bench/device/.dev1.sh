set -u
rm -rf bench/results/h200-2026-11-22/sweep bench/results/h100-2026-11-22/hicache_before_warmup
. bench/device/device_check.sh
git log --oneline -1 2>/dev/null || true
BEFORE="import sys,runpy; sys.meta_path[:]=[f for f in sys.meta_path if 'editable' not in repr(f).lower()]; sys.path.insert(0,'.before'); sys.argv=sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
echo "import gdskv, gdskv.kernels, gdskv.bench; print(gdskv.__file__, gdskv.kernels.__file__, gdskv.bench.__file__)" > /tmp/w.py; python3 -c "$BEFORE" /tmp/w.py
mkdir -p $OUT/cp
for bs in 2M:256M 16M:1G 256M:4G; do
  b=${bs%%:*}; s=${bs##*:}
  mkdir -p /dev/shm/cpb /dev/shm/cpa; timeout 100 python3 -c "$BEFORE" bench/experiments/call_profile.py --directory /dev/shm/cpb --bs $b --size $s --backend kvikio --phases --json $OUT/cp/before_$b.json > $OUT/cp/before_$b.txt 2>&1; rm -rf /dev/shm/cpb
  timeout 100 python3 bench/experiments/call_profile.py --directory /dev/shm/cpa --bs $b --size $s --backend kvikio --phases --json $OUT/cp/after_$b.json > $OUT/cp/after_$b.txt 2>&1; rm -rf /dev/shm/cpa
  grep -E "^(gdskv|raw) " $OUT/cp/before_$b.txt; echo after; grep -E "^(gdskv|raw) " $OUT/cp/after_$b.txt
done
