#!/usr/bin/env bash
# Gemma-3-270M CB at the paper's protocol (decided in session 37, before the run), resumed from its checkpoints.
# The worktree is at e800eb8, the commit the run started at (its training code is main's for CB).
[ -d /work/wt-run ] || git -C /work/main worktree add -f --detach /work/wt-run e800eb8
cd /work/wt-run
echo "=== $(date -u +%FT%TZ) cb resume at $(git rev-parse --short HEAD)" >> /work/main/runs/gemma3-cb-paper-compare.log
python -m train compare --backbone gemma3-270m --task cb --methods capt zero-shot majority linear-head p-tuning-v2 \
  --seeds 0 1 2 --quiet --resume --out /work/main/runs/gemma3-cb-paper-compare >> /work/main/runs/gemma3-cb-paper-compare.log 2>&1
echo "=== $(date -u +%FT%TZ) cb exit $?" >> /work/main/runs/gemma3-cb-paper-compare.log
