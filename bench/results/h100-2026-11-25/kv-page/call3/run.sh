. bench/device/device_check.sh >/dev/null
H=bench/experiments/hybrid_read.py
k=0
for m in kv-page own kv-page; do
  k=$((k+1)); echo "== hybrid shm $m"; timeout 110 python3 $H --dir /dev/shm --pages 512 --passes 24 --sidecar-store $m --out $OUT/hybrid_shm_${k}_${m}.json | tail -3
done
mkdir -p /var/tmp/gdskv-bench
for m in own kv-page; do
  k=$((k+1)); echo "== hybrid disk $m"; timeout 170 python3 $H --dir /var/tmp/gdskv-bench --pages 1024 --sidecar-store $m --out $OUT/hybrid_disk_${k}_${m}.json | tail -3
done
