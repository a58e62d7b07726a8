. bench/device/device_check.sh >/dev/null
H=bench/experiments/hybrid_read.py
mkdir -p /var/tmp/gdskv-bench
git log --oneline -1
date +%T; echo "== GPU tests"
timeout 150 python3 -m pytest -q -m "not slow" -rs tests/test_host_pages.py tests/test_byte_pages.py tests/test_gpu_tier.py tests/test_backend_kvikio.py tests/test_tier.py tests/test_corruption.py tests/test_kernels.py tests/test_pool_cache.py tests/test_hybrid_read.py > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
k=0
for m in gdskv pageable gdskv; do
  k=$((k+1)); date +%T; echo "== disk, scratch memory: $m (plain reads: as the pools)"
  timeout 170 python3 $H --dir /var/tmp/gdskv-bench --pages 1024 --passes 16 --scratch-memory $m --out $OUT/hybrid_disk_${k}_$m.json | tail -2
done
date +%T
