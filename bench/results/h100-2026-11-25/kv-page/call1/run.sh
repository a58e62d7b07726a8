. bench/device/device_check.sh >/dev/null
H=bench/experiments/hybrid_read.py
k=0
for m in kv-page own own kv-page; do
  k=$((k+1)); echo "== hybrid shm $m"; timeout 120 python3 $H --dir /dev/shm --pages 512 --sidecar-store $m --out $OUT/hybrid_shm_${k}_${m}.json | tail -3
done
mkdir -p /var/tmp/gdskv-bench
for m in ${DISK:-kv-page}; do
  k=$((k+1)); echo "== hybrid disk $m"; timeout 200 python3 $H --dir /var/tmp/gdskv-bench --pages 1024 --sidecar-store $m --out $OUT/hybrid_disk_${m}_${RANDOM}.json | tail -3
done
