. bench/device/device_check.sh >/dev/null
H=bench/experiments/hybrid_read.py
k=0
for d in auto off auto off; do
  k=$((k+1)); echo "== hybrid shm kv-page direct=$d"; GDSKV_DIRECT_IO=$d timeout 150 python3 $H --dir /dev/shm --pages 512 --passes 8 --sidecar-store kv-page --out $OUT/hybrid_shm_${k}_kv-page_direct-$d.json | tail -3
done
mkdir -p /var/tmp/gdskv-bench
k=$((k+1)); echo "== hybrid disk kv-page direct=off"; GDSKV_DIRECT_IO=off timeout 200 python3 $H --dir /var/tmp/gdskv-bench --pages 1024 --sidecar-store kv-page --out $OUT/hybrid_disk_${k}_kv-page_direct-off.json | tail -3
