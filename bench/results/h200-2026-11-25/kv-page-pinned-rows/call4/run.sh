. bench/device/device_check.sh >/dev/null
H=bench/experiments/hybrid_read.py
mkdir -p /var/tmp/gdskv-bench
date +%T; echo "== disk, the adapter's settings (scratch rows pinned), plain reads interleaved"
timeout 170 python3 $H --dir /var/tmp/gdskv-bench --pages 1024 --passes 16 --out $OUT/hybrid_disk_1.json | tail -2
date +%T; echo "== shm, the adapter's settings"
timeout 90 python3 $H --dir /dev/shm --pages 512 --passes 48 --out $OUT/hybrid_shm_2.json | tail -2
date +%T
