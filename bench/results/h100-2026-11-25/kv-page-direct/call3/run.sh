. bench/device/device_check.sh >/dev/null
H=bench/experiments/hybrid_read.py
mkdir -p /var/tmp/gdskv-bench
k=0
for m in shm disk shm disk shm; do
  k=$((k+1)); date +%T; echo "== hybrid $m, the adapter's settings"
  if [ $m = shm ]; then
    timeout 75 python3 $H --dir /dev/shm --pages 512 --passes 24 --raw-passes 8 --out $OUT/hybrid_shm_$k.json | tail -2
  else
    timeout 150 python3 $H --dir /var/tmp/gdskv-bench --pages 1024 --passes 8 --raw-passes 8 --out $OUT/hybrid_disk_$k.json | tail -2
  fi
done
date +%T
