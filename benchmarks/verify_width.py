"""What one more verified token per row costs: the verify forward's seconds against its width.

A scripted draft that proposes the target's own greedy continuation (every proposal accepted,
policy fixed) makes every round verify k + 1 tokens per row; the mean verify
seconds per round at k = 0 (a plain target step), 1, 2, ... show how the forward's cost grows with
the tokens it verifies at this batch size (the draft's own cost is not counted).

    python benchmarks/verify_width.py --target smollm2 --prompts question.jsonl --per-category 1 \
        --chat-template [--batch-size 13] [--ks 0,1,2,3,4,6] [--padding both]

--padding both runs every width twice in a row, with row counts padded as measured on this machine
(fast.compute.row_plan, the default) and without padding, to measure what the padding buys here.
"""
from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    from specbatch import generate
    from specbatch.cli.bench import select_prompts
    from specbatch.fast.drafts.scripted import ScriptedDraft
    from specbatch.fast.loading import load_model
    from specbatch.prepare import encode_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--per-category", type=int, default=0)
    p.add_argument("--chat-template", action="store_true")
    p.add_argument("--batch-size", type=int, default=13)
    p.add_argument("--max-new-tokens", type=int, default=49)
    p.add_argument("--ks", default="0,1,2,3,4,6")
    p.add_argument("--padding", choices=["measured", "off", "both"], default="measured",
                   help="row counts padded as measured on this machine (fast.compute.row_plan), no padding (off), "
                        "or each width with both")
    args = p.parse_args()
    from specbatch.fast.compute import kernels
    settings = {"measured": [True], "off": [False], "both": [True, False]}[args.padding]
    target, tokenizer = load_model(args.target, "float32")
    prompts = select_prompts(args.prompts, args.per_category)
    ids = encode_prompts([text for _, text in prompts], tokenizer, args.chat_template)[:args.batch_size]
    never = lambda index, token: np.zeros(np.shape(index), dtype=bool)  # noqa: E731 (never deviate)
    draft = ScriptedDraft(target, never)
    print(f"batch {len(ids)}: | k | padding | verified tokens per row | rounds | verify ms per round | "
          "ms per verified token |")
    for k, padding in ((int(x), padding) for x in args.ks.split(",") for padding in settings):
        kernels.PAD_ROWS = padding
        options = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
        if k:
            result = generate(target, draft, ids, num_draft_tokens=k, policy="fixed", **options)
        else:
            result = generate(target, None, ids, **options)
        per_round = 1000 * result.stats["time_verify"] / result.stats["rounds"]
        print(f"| {k} | {'measured' if padding else 'off'} | {k + 1} | {result.stats['rounds']} | {per_round:.1f} | {per_round / len(ids) / (k + 1):.2f} |")


if __name__ == "__main__":
    main()
