"""The target's next-token distribution at every answer position, for soft-label distillation.

train_draft.py learns the target's greedy token from hard labels; with `--teacher FILE` it also
learns the target's distribution (its top `--top-k` probabilities) at the same positions, which
carries what a single label does not: how sure the target is and what it would say instead. This
script computes that file once: one forward of the target over each example (chat-templated prompt
+ answer, exactly as train_draft.load_examples builds it), the head applied at the answer positions
only.

    python training/teacher_probs.py --prompts training/data/stage1.jsonl training/data/stage2.jsonl \
        --answers training/data/stage1_answers.jsonl training/data/stage2_answers.jsonl \
        --out training/data/teacher_top16.pt

Writes {id: (indices int32 [n, K], probabilities float16 [n, K])}, row j the distribution that
predicts answer token j (n answer tokens of the example).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_draft import answer_logits, collate, data_arguments, load_examples, make_batches  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data_arguments(parser)  # the same examples and batching as train_draft.py
    parser.add_argument("--top-k", type=int, default=16)
    args = parser.parse_args(argv)

    from specbatch.fast.loading import load_model
    target, tokenizer = load_model(args.target)
    examples = load_examples(args.prompts, args.answers, tokenizer, args.max_len)
    pad_id = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    out, done, start = {}, 0, time.time()
    with torch.inference_mode():
        for batch in make_batches(examples, args.tokens_per_batch, random.Random(0)):
            ids, attention, rows, positions, labels = collate(batch, pad_id)
            probs = torch.softmax(answer_logits(target, ids, attention, rows, positions), dim=-1)
            top = probs.topk(args.top_k, dim=-1)
            agree = (top.indices[:, 0] == labels).float().mean().item()
            offset = 0
            for ident, tokens, first_answer in batch:
                n = len(tokens) - first_answer
                out[ident] = (top.indices[offset:offset + n].to(torch.int32).clone(),
                              top.values[offset:offset + n].to(torch.float16).clone())
                offset += n
            done += len(batch)
            print(f"{done}/{len(examples)} examples, {time.time() - start:.0f} s, top-1 = label on "
                  f"{agree:.3f} of this batch's positions", flush=True)
    torch.save(out, args.out)
    print(f"saved {len(out)} examples to {args.out}")


if __name__ == "__main__":
    main()
