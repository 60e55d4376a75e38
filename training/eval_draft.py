"""Mean accepted length τ of drafts for SmolLM2-135M-Instruct, per Spec-Bench category.

Runs target-only decoding once (the reference for exact match and speed) and then speculative
decoding with each draft, all greedy, on the first N first-turn questions of every category, with
the chat template; prints a markdown table (τ per category and overall, tokens/s, speed-up over
target-only decoding at the same batch size, exact match) and writes it as JSON.

    python training/eval_draft.py --questions ../shared/data/spec_bench/question.jsonl \
        --drafts lookup smollm2-draft smollm2-draft+lookup --per-category 4 --batch-size 8
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path



def spec_bench_questions(path, per_category: int) -> list[tuple[str, str]]:
    """(category, first turn) of the first `per_category` questions of each category, in file order."""
    chosen, seen = [], {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            seen[record["category"]] = seen.get(record["category"], 0) + 1
            if seen[record["category"]] <= per_category:
                chosen.append((record["category"], record["turns"][0]))
    return chosen


def tau_by_category(categories, result) -> dict:
    """Committed tokens per row per round (bonus included) over each category's requests."""
    tokens, rounds = {}, {}
    for category, sequence, stats in zip(categories, result.sequences, result.request_stats):
        tokens[category] = tokens.get(category, 0) + len(sequence)
        rounds[category] = rounds.get(category, 0) + stats["rounds"]
    return {c: tokens[c] / max(rounds[c], 1) for c in tokens}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", required=True, help="Spec-Bench question.jsonl")
    parser.add_argument("--drafts", nargs="+", default=["smollm2-draft+lookup"])
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--strategy", default="ragged")
    parser.add_argument("--out", default="draft_eval.json")
    args = parser.parse_args(argv)

    import specbatch
    from specbatch.fast.acceptance import simulate_rounds
    from specbatch.fast.loading import load_draft, load_model

    target, tokenizer = load_model("smollm2")
    questions = spec_bench_questions(args.questions, args.per_category)
    categories = [c for c, _ in questions]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
           for _, q in questions]
    kw = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, strategy=args.strategy, progress=True)
    reference = specbatch.generate(target, None, ids, **kw)
    rows = []
    for name in args.drafts:
        draft, _ = load_draft(name, target)
        result = specbatch.generate(target, draft, ids, num_draft_tokens=args.num_draft_tokens, **kw)
        rows.append(dict(
            draft=name, tau=result.stats["mean_accepted_length"], tau_by_category=tau_by_category(categories, result),
            tokens_per_second=result.stats["tokens_per_second"],
            speedup=result.stats["tokens_per_second"] / reference.stats["tokens_per_second"],
            exact_match=sum(a == b for a, b in zip(result.sequences, reference.sequences)),
            lookup_proposals=getattr(draft, "lookup_proposals", None)))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "tau_by_category"}), flush=True)
    names = sorted(set(categories), key=categories.index)
    lines = ["| category | n | " + " | ".join(r["draft"] for r in rows) + " |",
             "|---|---|" + "---|" * len(rows)]
    for c in names:
        lines.append(f"| {c} | {categories.count(c)} | " + " | ".join(f"{r['tau_by_category'][c]:.2f}" for r in rows)
                     + " |")
    lines.append(f"| **all** (τ) | {len(ids)} | " + " | ".join(f"**{r['tau']:.2f}**" for r in rows) + " |")
    lines.append("| tokens/s | | " + " | ".join(f"{r['tokens_per_second']:.1f}" for r in rows) + " |")
    lines.append(f"| vs target only ({reference.stats['tokens_per_second']:.1f} tokens/s) | | "
                 + " | ".join(f"{r['speedup']:.2f}x" for r in rows) + " |")
    lines.append("| exact match | | " + " | ".join(f"{r['exact_match']}/{len(ids)}" for r in rows) + " |")
    table = "\n".join(lines)
    print(f"\nbatch {args.batch_size}, k = {args.num_draft_tokens}, {args.max_new_tokens} new tokens, "
          f"{args.strategy}, greedy\n\n{table}")
    Path(args.out).write_text(json.dumps(dict(settings=vars(args), reference_tokens_per_second=
                                              reference.stats["tokens_per_second"], drafts=rows, table=table),
                                         indent=1) + "\n")


if __name__ == "__main__":
    main()
