#!/usr/bin/env bash
# The whole distillation of fast/distilled/smollm2-draft, as it was run (2 CPU cores):
#   1. 1,600 stage-1 prompts written by training/distill_prompts.py; the target answers them
#      greedily (at most 192 tokens) through specbatch itself (target only, ragged, batch 64);
#   2. 180 stage-2 long-context prompts built from those answers; answered the same way (128 tokens);
#   3. train_draft.py on both (time budget 28 minutes).
# Every generation step is resumable: rerun the script after an interruption and `--resume` skips
# the requests already answered (each answer is flushed to disk as soon as it is complete).
set -euo pipefail
cd "$(dirname "$0")/.."
data=training/data
mkdir -p "$data"

[ -f "$data/stage1.jsonl" ] || python training/distill_prompts.py stage1 --out "$data/stage1.jsonl"
specbatch generate --target smollm2 --draft none --prompts "$data/stage1.jsonl" --chat-template \
    --strategy ragged --batch-size 64 --max-new-tokens 192 --out "$data/stage1_answers.jsonl" --resume

[ -f "$data/stage2.jsonl" ] || python training/distill_prompts.py stage2 --count 180 \
    --answers "$data/stage1_answers.jsonl" --out "$data/stage2.jsonl"
specbatch generate --target smollm2 --draft none --prompts "$data/stage2.jsonl" --chat-template \
    --strategy ragged --batch-size 32 --max-new-tokens 128 --out "$data/stage2_answers.jsonl" --resume

python training/train_draft.py --prompts "$data/stage1.jsonl" "$data/stage2.jsonl" \
    --answers "$data/stage1_answers.jsonl" "$data/stage2_answers.jsonl" \
    --out fast/distilled/smollm2-draft --epochs 40 --max-minutes 28 --seed 0
