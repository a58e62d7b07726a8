. bench/device/device_check.sh >/dev/null
H=bench/experiments/hybrid_read.py
mkdir -p /var/tmp/gdskv-bench
for f in --hybrid-store-first ""; do
  echo "== hybrid disk kv-page $f"; timeout 175 python3 $H --dir /var/tmp/gdskv-bench --pages 1024 --sidecar-store kv-page $f --out $OUT/hybrid_disk_kv-page${f:+_hybrid-first}.json | tail -3
done
