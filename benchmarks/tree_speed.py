"""Chains against token trees, side by side in one run: target-only decoding, then speculation with
tree_branches = 1 (chains), 2, 3, ... at each batch size, the order alternating between repeats.

For each (batch size, branches): tokens per second (median over repeats), its ratio to target-only
decoding measured in the same repeats, tau (tokens committed per row-round), the draft nodes
verified per row-round, the share of verified leaves accepted, and how many outputs equal
target-only greedy decoding (bitwise, else the first divergence judged a floating-point tie or an
error by the ulp rule: specbatch.cli.bench.Judge). A calibration before
and after says whether the run may be quoted (specbatch.cli.calibration). Models load once; every
run is warm (a first untimed run per batch size).

    python benchmarks/tree_speed.py --target smollm2 --draft smollm2-draft+lookup --chat-template \
        --prompts question.jsonl --per-category 1 --batch-sizes 1,4,13 --branches 1,2,3 --repeats 2 \
        --out docs/results/trees [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from specbatch import generate
from specbatch.cli import calibration
from specbatch.cli.bench import select_prompts
from specbatch.cli.machine import describe_machine
from specbatch.fast.loading import load_draft, load_model
from specbatch.prepare import encode_prompts

SHIPPED_PROMPTS = Path(__file__).parents[1] / "specbatch" / "data" / "prompts.jsonl"


def timed(target, draft, ids, batch: int, new: int, branches: int | None) -> dict:
    """One run: branches None is target-only decoding."""
    start = time.perf_counter()
    if branches is None:
        result = generate(target, None, ids, max_new_tokens=new, batch_size=batch)
    else:
        result = generate(target, draft, ids, max_new_tokens=new, batch_size=batch, tree_branches=branches)
    seconds = time.perf_counter() - start
    stats = result.stats
    return dict(seconds=seconds, tokens_per_second=stats["generated_tokens"] / seconds,
                tau=stats["mean_accepted_length"], nodes=stats["nodes_per_row_round"],
                leaves=stats.get("leaves_verified", 0), leaves_accepted=stats.get("leaves_accepted", 0),
                sequences=result.sequences)


def worst_agreement(target, ids, mine: list[dict], baseline: list[dict]) -> dict:
    """The repeat that agrees least with its own target-only run (specbatch.cli.bench.least_agreeing)."""
    from specbatch.cli.bench import Judge, least_agreeing
    return least_agreeing([Judge(target, ids, b["sequences"], greedy=True)(m["sequences"])
                           for m, b in zip(mine, baseline)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--draft", default="smollm2-draft+lookup")
    p.add_argument("--prompts", default=str(SHIPPED_PROMPTS))
    p.add_argument("--per-category", type=int, default=0)
    p.add_argument("--chat-template", action="store_true")
    p.add_argument("--batch-sizes", default="1,4,13")
    p.add_argument("--branches", default="1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--out", required=True, help="folder for results.json and results.md")
    p.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    args = p.parse_args()
    out = Path(args.out)
    if (out / "results.json").exists() and not args.overwrite:
        sys.exit(f"error: {out / 'results.json'} exists; pass --overwrite to replace it")
    target, tokenizer = load_model(args.target, args.dtype)
    draft, _ = load_draft(args.draft, target)
    texts = [text for _, text in select_prompts(args.prompts, args.per_category)]
    ids = encode_prompts(texts, tokenizer, args.chat_template)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    branch_list = [int(b) for b in args.branches.split(",")]
    from specbatch.cli.bench import agreement, prepare_kernels
    from specbatch.options import defaults
    prepare_kernels(target, draft, defaults())
    before = calibration.calibrate()
    rows = []
    for batch in batches:
        timed(target, draft, ids[:batch], batch, 8, branch_list[-1])  # warm
        runs = {b: [] for b in [None] + branch_list}
        for repeat in range(args.repeats):
            order = [None] + branch_list
            for branches in (order if repeat % 2 == 0 else order[::-1]):
                runs[branches].append(timed(target, draft, ids, batch, args.max_new_tokens, branches))
                print(f"batch {batch} branches {branches}: {runs[branches][-1]['tokens_per_second']:.1f} tok/s",
                      file=sys.stderr, flush=True)
        baseline = runs[None]
        for branches in branch_list:
            mine = runs[branches]
            ratios = [m["tokens_per_second"] / b["tokens_per_second"] for m, b in zip(mine, baseline)]
            rows.append(dict(batch=batch, branches=branches,
                             tokens_per_second=statistics.median(m["tokens_per_second"] for m in mine),
                             target_only_tokens_per_second=statistics.median(b["tokens_per_second"] for b in baseline),
                             ratio=statistics.median(ratios), ratios=ratios,
                             tau=statistics.median(m["tau"] for m in mine),
                             nodes_per_row_round=statistics.median(m["nodes"] for m in mine),
                             leaves_accepted_share=statistics.median(
                                 m["leaves_accepted"] / m["leaves"] if m["leaves"] else 0.0 for m in mine),
                             **agreement(worst_agreement(target, ids, mine, baseline), len(ids))))
    after = calibration.calibrate()
    judged = calibration.verdict(before, after)
    report = dict(command=" ".join(sys.argv), machine=describe_machine(), calibration_before=before,
                  calibration_after=after, verdict=judged, rows=rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"`{report['command']}`", "", f"Machine: {report['machine']['summary']}.", "",
             calibration.describe(before, after, judged), "",
             "| batch | tree_branches | tokens/s | target-only tokens/s | speculative / target-only | tau | "
             "nodes per row-round | leaves accepted | exact |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['branches']} | {r['tokens_per_second']:.1f} | "
              f"{r['target_only_tokens_per_second']:.1f} | {r['ratio']:.2f}x | {r['tau']:.2f} | "
              f"{r['nodes_per_row_round']:.2f} | {r['leaves_accepted_share']:.0%} | {r['exact']} |"
              for r in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
