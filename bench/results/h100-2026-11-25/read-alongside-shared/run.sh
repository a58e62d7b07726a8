. bench/device/device_check.sh >/dev/null
H=bench/experiments/hybrid_read.py
for m in off on on off; do
  echo "== hybrid shm $m"; timeout 120 python3 $H --dir /dev/shm --pages 512 --sidecar-with-kv $m --out $OUT/hybrid_shm_${m}_$RANDOM.json | tail -3
done
mkdir -p /var/tmp/gdskv-bench
for m in on off; do
  echo "== hybrid disk $m"; timeout 170 python3 $H --dir /var/tmp/gdskv-bench --pages 1024 --sidecar-with-kv $m --out $OUT/hybrid_disk_${m}_$RANDOM.json | tail -3
done
