. bench/device/device_check.sh >/dev/null
H=bench/experiments/hybrid_read.py
mkdir -p /var/tmp/gdskv-bench
nproc; free -g | head -2
for k in 1 2; do
  date +%T; echo "== hybrid disk $k, the adapter's settings, plain reads interleaved"
  timeout 200 python3 $H --dir /var/tmp/gdskv-bench --pages 1024 --passes 16 --out $OUT/hybrid_disk_$k.json | tail -2
done
date +%T; echo "== hybrid shm"
timeout 100 python3 $H --dir /dev/shm --pages 512 --passes 48 --out $OUT/hybrid_shm_1.json | tail -2
date +%T
