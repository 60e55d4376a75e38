"""Mean accepted length τ of drafts for SmolLM2-135M-Instruct, per category, greedy, k = 4.

Spec-Bench (never trained on): target-only decoding once gives the target's greedy answers (and
the target-only speed); each draft's rounds are then replayed with the draft alone
(specbatch.fast.acceptance: exactly the rounds the engine would take, tests/test_acceptance.py);
drafts named in --run are also run for real through the engine (tokens/s, speed-up over target-only
decoding at the same batch size, exact match, measured τ).

    python training/eval_draft.py specbench --questions question.jsonl \
        --drafts lookup smollm2-draft smollm2-draft+lookup --per-category 3

Cost of a draft step against a target step at batch 1:

    python training/eval_draft.py stepcost --drafts smollm2-draft smollm2-draft+lookup

Held-out distillation answers (the validation split of train_draft.py; already the target's
greedy answers, so only the replay runs):

    python training/eval_draft.py heldout --prompts training/data/stage1.jsonl \
        --answers training/data/stage1_answers.jsonl --drafts smollm2-draft smollm2-draft+lookup
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path



def replay_tau(draft, ids, answers, categories, k: int, threshold: float = 0.0, floor: float | None = None
               ) -> tuple[float, dict]:
    """τ overall and per category from draft-only replays of the known greedy answers (threshold and
    floor: the proposal rule's, without the cost controller)."""
    from specbatch.fast.acceptance import simulate_rounds
    tokens, rounds = {}, {}
    for prompt, answer, category in zip(ids, answers, categories):
        n, r = simulate_rounds(draft, prompt, answer, k, threshold, floor)
        tokens[category] = tokens.get(category, 0) + n
        rounds[category] = rounds.get(category, 0) + r
    return sum(tokens.values()) / max(sum(rounds.values()), 1), {c: tokens[c] / max(rounds[c], 1) for c in tokens}


def step_ms(model, context: int = 300, steps: int = 40) -> float:
    """Median wall time (ms) of one 1-token decoding step at batch 1 after a `context`-token prefill,
    through the engine's model call (explicit positions, 4D mask, transformers cache)."""
    import time

    import torch

    from specbatch.fast.acceptance import UnpaddedRow
    from specbatch.fast.compute.attention import engine_attention
    from specbatch.fast.compute.kernels import prepacked_linears
    row = UnpaddedRow(model)
    ids = torch.randint(100, 40000, (context + steps,), generator=torch.Generator().manual_seed(0)).tolist()
    times = []
    with engine_attention(model), prepacked_linears(model):  # the engine's attention and linear layers
        row.feed(ids[:context])
        for token in ids[context:]:
            start = time.perf_counter()
            row.feed([token])
            times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


def markdown(rows, categories, extra_lines) -> str:
    names = sorted(set(categories), key=categories.index)
    lines = ["| category | n | " + " | ".join(r["draft"] for r in rows) + " |", "|---|---|" + "---|" * len(rows)]
    for c in names:
        lines.append(f"| {c} | {categories.count(c)} | " + " | ".join(f"{r['tau_by_category'][c]:.2f}" for r in rows)
                     + " |")
    lines.append(f"| **all** (τ) | {len(categories)} | " + " | ".join(f"**{r['tau']:.2f}**" for r in rows) + " |")
    return "\n".join(lines + extra_lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["specbench", "heldout", "stepcost"])
    parser.add_argument("--questions", help="Spec-Bench question.jsonl (specbench)")
    parser.add_argument("--prompts", nargs="+", help="distillation prompt files (heldout)")
    parser.add_argument("--answers", nargs="+", help="the target's answers to them (heldout)")
    parser.add_argument("--drafts", nargs="+", default=["smollm2-draft+lookup"])
    parser.add_argument("--run", nargs="*", default=[], help="drafts also run through the engine (specbench)")
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--limit", type=int, default=24, help="held-out examples (heldout)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--draft-threshold", type=float, default=0.0,
                        help="replay with the proposal rule's confidence threshold (0: every row drafts k)")
    parser.add_argument("--draft-floor", type=float, default=None,
                        help="replay with the proposal rule's floor (default: the threshold: the step below it "
                        "never proposes)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--strategy", default="ragged")
    parser.add_argument("--out", default="draft_eval.json")
    args = parser.parse_args(argv)

    import specbatch
    from specbatch.cli.bench import first_per_category, prompt_categories
    from specbatch.prepare import encode_prompts
    from specbatch.fast.loading import load_draft, load_model
    from specbatch.io import read_prompts

    target, tokenizer = load_model("smollm2")
    k = args.num_draft_tokens
    if args.mode == "stepcost":
        for _ in range(2):  # the second round is the one to read (warm caches)
            target_ms = step_ms(target)
            costs = {name: step_ms(load_draft(name, target)[0]) for name in args.drafts}
        print(f"target step {target_ms:.1f} ms at batch 1 (300-token context); "
              + "; ".join(f"{n} {ms:.1f} ms = {ms / target_ms:.1%}" for n, ms in costs.items()))
        return
    extra, reference_speed, runs, kw = [], None, [], {}
    if args.mode == "specbench":
        all_categories, questions = prompt_categories(args.questions), read_prompts(args.questions)  # first turns
        chosen = first_per_category(all_categories, args.per_category)
        categories = [all_categories[i] for i in chosen]
        ids = encode_prompts([questions[i][1] for i in chosen], tokenizer, chat_template=True)
        kw = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, strategy=args.strategy,
                  progress=True)
        reference = specbatch.generate(target, None, ids, **kw)
        answers, reference_speed = reference.sequences, reference.stats["tokens_per_second"]
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        from train_draft import is_validation, load_examples
        examples = [e for e in load_examples(args.prompts, args.answers, tokenizer, 4096) if is_validation(e[0], 0.04)]
        examples = examples[:args.limit]
        categories = [e[0].split("-")[-1] for e in examples]
        ids = [e[1][:e[2]] for e in examples]
        answers = [e[1][e[2]:][:args.max_new_tokens] for e in examples]
    rows = []
    for name in args.drafts:
        draft, _ = load_draft(name, target)
        tau, per_category = replay_tau(draft, ids, answers, categories, k, args.draft_threshold, args.draft_floor)
        rows.append(dict(draft=name, tau=tau, tau_by_category=per_category))
        print(json.dumps(dict(draft=name, replayed_tau=round(tau, 3))), flush=True)
        if name in args.run:
            result = specbatch.generate(target, draft, ids, num_draft_tokens=k, **kw)
            runs.append(dict(draft=name, tau=result.stats["mean_accepted_length"],
                             tokens_per_second=result.stats["tokens_per_second"],
                             speedup=result.stats["tokens_per_second"] / reference_speed,
                             exact_match=sum(a == b for a, b in zip(result.sequences, answers))))
            print(json.dumps(runs[-1]), flush=True)
    for run in runs:
        extra.append(f"- {run['draft']} through the engine ({args.strategy}, batch {args.batch_size}): τ {run['tau']:.2f}, "
                     f"{run['tokens_per_second']:.1f} tokens/s = {run['speedup']:.2f}x target-only decoding "
                     f"({reference_speed:.1f} tokens/s), exact match {run['exact_match']}/{len(ids)}")
    table = markdown(rows, categories, [""] + extra if extra else [])
    print(f"\n{args.mode}: k = {k}, at most {args.max_new_tokens} new tokens, greedy\n\n{table}")
    from specbatch.cli.machine import describe_machine
    command = "python training/eval_draft.py " + " ".join(sys.argv[1:] if argv is None else argv)
    machine = describe_machine()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(command=command, machine=machine, settings=vars(args),
                                   reference_tokens_per_second=reference_speed, drafts=rows, runs=runs, table=table),
                              indent=1) + "\n")
    out.with_suffix(".md").write_text(f"Command: `{command}`\n\nMachine: {machine['summary']}\n\n"
                                      f"{args.mode}: k = {k}, at most {args.max_new_tokens} new tokens, greedy\n\n"
                                      f"{table}\n")


if __name__ == "__main__":
    main()
