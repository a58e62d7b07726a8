. bench/device/device_check.sh >/dev/null
H=bench/experiments/hybrid_read.py
mkdir -p /var/tmp/gdskv-bench
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag
df /var/tmp | tail -1; lsblk -o NAME,TYPE,SIZE,MOUNTPOINT | head
for d in /sys/block/*/queue; do echo "$d seg=$(cat $d/max_segments) segsize=$(cat $d/max_segment_size) sectors_kb=$(cat $d/max_sectors_kb) hw_kb=$(cat $d/max_hw_sectors_kb) nr=$(cat $d/nr_requests)"; done
k=0
for m in pageable pinned huge; do
  k=$((k+1)); date +%T; echo "== disk, plain + scratch memory: $m"
  timeout 170 python3 $H --dir /var/tmp/gdskv-bench --pages 1024 --passes 16 --plain-memory $m --scratch-memory $m --out $OUT/hybrid_disk_${k}_$m.json | tail -2
done
date +%T
