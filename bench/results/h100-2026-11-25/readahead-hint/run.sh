. bench/device/device_check.sh >/dev/null
S=bench/experiments/sidecar_call.py; H=bench/experiments/hybrid_read.py
for h in hint nohint nohint hint; do
  a=""; [ $h = nohint ] && a=nohint
  echo "== sidecar $h"; python3 .dev/ab.py after $a $S --dir /dev/shm --reps 40 | tee -a $OUT/sidecar_$h.jsonl
done
for h in nohint hint; do
  a=""; [ $h = nohint ] && a="--no-readahead-hint"
  echo "== hybrid shm $h"; timeout 100 python3 $H --dir /dev/shm --pages 512 $a --out $OUT/hybrid_shm_$h.json | tail -2
done
