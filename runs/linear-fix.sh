#!/usr/bin/env bash
# The linear head on COPA rerun after dc505ad (its text lists the alternatives), at each compare's settings.
cd /work/wt-fix
L=/work/main/runs/linear-fix.log
echo "=== $(date -u +%FT%TZ) gemma copa linear-head (compare --resume) at $(git rev-parse --short HEAD)" >> $L
python -m train compare --backbone gemma3-270m --task copa --methods capt zero-shot majority linear-head p-tuning-v2 \
  --seeds 0 1 2 --quiet --resume --out /work/main/runs/gemma3-copa-paper-compare >> $L 2>&1
echo "=== $(date -u +%FT%TZ) exit $?; smollm2 copa linear-head" >> $L
python -m train compare --task copa --methods linear-head --seeds 0 1 2 --quiet --out /work/main/runs/copa-linear-head-fixed >> $L 2>&1
echo "=== $(date -u +%FT%TZ) exit $?" >> $L
