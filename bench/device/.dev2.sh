set -u
rm -rf bench/results/h200-2026-11-22/sweep bench/results/h100-2026-11-22/hicache_before_warmup
. bench/device/device_check.sh >/dev/null
mkdir -p $OUT/cp /dev/shm/st
timeout 120 python3 bench/experiments/small_call_steps.py --directory /dev/shm/st --pages 1 8 128 --json $OUT/cp/steps.json 2>&1 | tail -45
for b in 2M:256M 16M:1G 256M:4G; do
  bs=${b%%:*}; s=${b##*:}
  for v in plain fused plain fused; do
    mkdir -p /dev/shm/cp; f=""; [ $v = plain ] && f=--plain-verify
    timeout 100 python3 bench/experiments/call_profile.py --directory /dev/shm/cp --bs $bs --size $s --backend kvikio $f > /tmp/o.txt 2>&1; rm -rf /dev/shm/cp
    echo "$bs $v: $(grep -E '^(gdskv|raw) ' /tmp/o.txt | tr -s ' ' | tr '\n' '|')"
  done
done
