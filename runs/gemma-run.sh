#!/usr/bin/env bash
# Gemma-3-270M paper-protocol compares, decided before the run (2026-12-07, session 37): COPA, then CB.
cd /work/wt-run
for t in copa cb; do
  echo "=== $(date -u +%FT%TZ) $t start at $(git rev-parse --short HEAD)" >> /work/main/runs/gemma3-$t-paper-compare.log
  python -m train compare --backbone gemma3-270m --task $t --methods capt zero-shot majority linear-head p-tuning-v2 \
    --seeds 0 1 2 --quiet --resume --out /work/main/runs/gemma3-$t-paper-compare >> /work/main/runs/gemma3-$t-paper-compare.log 2>&1
  echo "=== $(date -u +%FT%TZ) $t exit $?" >> /work/main/runs/gemma3-$t-paper-compare.log
done
