. bench/device/device_check.sh >/dev/null
H=bench/experiments/hybrid_read.py
mkdir -p /var/tmp/gdskv-bench
k=0
for d in adapter on adapter on; do
  k=$((k+1)); date +%T; echo "== hybrid shm, hybrid store direct_io=$d"
  timeout 75 python3 $H --dir /dev/shm --pages 512 --passes 24 --raw-passes 8 --sidecar-direct-io $d --out $OUT/hybrid_shm_${k}_$d.json | tail -2
done
date +%T; echo "== hybrid disk, the adapter's setting (O_DIRECT)"
timeout 200 python3 $H --dir /var/tmp/gdskv-bench --pages 1024 --passes 8 --raw-passes 8 --out $OUT/hybrid_disk_5_adapter.json | tail -3
date +%T
