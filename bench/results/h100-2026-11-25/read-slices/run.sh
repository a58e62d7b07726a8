. bench/device/device_check.sh >/dev/null
lscpu | grep -E 'Model name|L1d|L2|L3|^CPU\(s\)'
S=bench/experiments/sidecar_call.py; H=bench/experiments/hybrid_read.py
for r in 1 2; do
  for w in before after after before; do
    echo "== sidecar $w run$r"; python3 .dev/ab.py $w $S --dir /dev/shm | tee -a $OUT/sidecar_$w.jsonl
  done
done
for s in 131072 524288 1048576; do
  echo "== sidecar after slice=$s"; python3 .dev/ab.py after slice=$s $S --dir /dev/shm | tee -a $OUT/sidecar_after_slice$s.jsonl
done
echo "== phases after"; python3 .dev/ab.py after $S --dir /dev/shm --phases 2>&1 | head -14 | tee $OUT/sidecar_phases_after.txt
for w in before after after before; do
  echo "== hybrid shm $w"; timeout 150 python3 .dev/ab.py $w $H --dir /dev/shm --pages 512 --out $OUT/hybrid_shm_${w}_$RANDOM.json | tail -c 600
done
