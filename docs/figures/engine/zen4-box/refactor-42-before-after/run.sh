#!/bin/bash
# Issue 42's keep-check: the engine before the refactors (95447ff, installed from its wheel in /tmp/benchvenv)
# and after (the checkout), interleaved, same sitting. engine_bench's decode, hybrid, overhead and chunking
# at bf16 + int4 (serve's default), 2 threads.
set -u
D=/work/main/docs/figures/engine/zen4-box/refactor-42-before-after
mkdir -p $D
args="--lengths 2048 --budgets 256,512 --batches 1,8,32 --reps 1 --steps 12 --threads 2 --dtype bfloat16 --quantization int4"
log() { echo "$(date +%T) $* load $(cut -d' ' -f1-3 /proc/loadavg)" >> $D/sitting.log; }
for r in 1 2 3; do
  if [ $((r % 2)) = 1 ]; then order="before after"; else order="after before"; fi
  for t in $order; do
    log "start $t r$r"
    if [ $t = before ]; then (cd /tmp/benchexp && /tmp/benchvenv/bin/python -m experiments.engine_bench $args --out $D/$t-r$r > $D/$t-r$r.out 2>&1)
    else (cd /work/main && .venv/bin/python -m experiments.engine_bench $args --out $D/$t-r$r > $D/$t-r$r.out 2>&1); fi
    log "done $t r$r rc=$?"
  done
done
