. bench/device/device_check.sh >/dev/null
H=bench/experiments/hybrid_read.py
mkdir -p /var/tmp/gdskv-bench
echo "== host-page tests"; timeout 60 python3 -m pytest -q tests/test_host_pages.py 2>&1 | tail -2
date +%T; echo "== hybrid disk, both stores O_DIRECT (the adapter now)"
timeout 230 python3 $H --dir /var/tmp/gdskv-bench --pages 1024 --passes 8 --raw-passes 8 --out $OUT/hybrid_disk_1_direct.json | tail -3
date +%T; echo "== hybrid shm, both stores O_DIRECT"
timeout 80 python3 $H --dir /dev/shm --pages 512 --passes 24 --raw-passes 8 --out $OUT/hybrid_shm_2_direct.json | tail -3
date +%T; echo "== hybrid disk, hybrid store buffered (the adapter before)"
timeout 200 python3 $H --dir /var/tmp/gdskv-bench --pages 1024 --passes 8 --raw-passes 8 --sidecar-direct-io off --out $OUT/hybrid_disk_3_buffered.json | tail -3
date +%T
