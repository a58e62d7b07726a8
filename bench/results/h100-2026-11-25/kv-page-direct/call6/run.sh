. bench/device/device_check.sh >/dev/null
H=bench/experiments/hybrid_read.py
mkdir -p /var/tmp/gdskv-bench
for k in 1 2; do
  date +%T; echo "== hybrid disk, the adapter's settings"
  timeout 150 python3 $H --dir /var/tmp/gdskv-bench --pages 1024 --passes 8 --raw-passes 8 --out $OUT/hybrid_disk_$k.json | tail -2
done
date +%T
