"""How often a draft's proposal is accepted, by the draft's confidence (the proposal rule's input).

Runs specbatch.generate with every row drafting its whole limit (policy fixed), writes
a round trace, and counts, for each proposal whose earlier proposals were all accepted, whether the
target accepted it, in bins of the draft's confidence at that step. A calibrated draft accepts about
as often as it is confident; the bins show where a threshold stops wasting verify tokens and draft
steps (fast.proposals, specbatch.options: the default threshold).

    python benchmarks/draft_calibration.py --target smollm2 --draft smollm2-draft+lookup \
        --prompts question.jsonl --per-category 1 --chat-template [--batch-size 13] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

EDGES = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0001]


def reached_proposals(trace_path) -> np.ndarray:
    """[N, 3]: (depth, confidence, accepted 0/1) of every proposal whose earlier ones were accepted."""
    out = []
    with open(trace_path) as f:
        for line in f:
            record = json.loads(line)
            for row in record.get("rows", []):
                for depth in range(int(row["draft_limit"])):
                    if row["accepted"] >= depth:
                        out.append((depth, row["draft_confidence"][depth], int(row["accepted"] > depth)))
    return np.array(out, dtype=float).reshape(-1, 3)


def table(reached: np.ndarray) -> list[dict]:
    rows = []
    for low, high in zip(EDGES, EDGES[1:]):
        inside = (reached[:, 1] >= low) & (reached[:, 1] < high)
        if inside.any():
            rows.append(dict(confidence=f"[{low:.2f}, {min(high, 1.0):.2f}{']' if high > 1 else ')'}",
                             proposals=int(inside.sum()), accepted=round(float(reached[inside, 2].mean()), 3)))
    return rows


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of a run in which every row drafts its whole limit (also lookup_acceptance.py)."""
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--per-category", type=int, default=0)
    p.add_argument("--chat-template", action="store_true")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=13)
    p.add_argument("--num-draft-tokens", type=int, default=4)


@contextmanager
def drafting_trace(args):
    """Run generate with policy fixed, tracing every round: yields (target, the
    trace's path, the encoded prompts); the trace is removed afterwards."""
    from specbatch import generate
    from specbatch.cli.bench import select_prompts
    from specbatch.fast.loading import load_draft, load_model
    from specbatch.prepare import encode_prompts
    target, tokenizer = load_model(args.target, "float32")
    draft, _ = load_draft(args.draft, target, "float32", "cpu")
    prompts = select_prompts(args.prompts, args.per_category)
    ids = encode_prompts([text for _, text in prompts], tokenizer, args.chat_template)
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.jsonl"
        generate(target, draft, ids, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                 num_draft_tokens=args.num_draft_tokens, policy="fixed", trace=trace)
        yield target, trace, ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(p)
    p.add_argument("--out", default=None, help="write the table as JSON here too")
    args = p.parse_args()
    with drafting_trace(args) as (_, trace, ids):
        reached = reached_proposals(trace)
    rows = table(reached)
    print(f"{len(reached)} proposals reached (earlier ones accepted), {len(ids)} prompts")
    print("| draft confidence | proposals | accepted |\n|---|---|---|")
    for r in rows:
        print(f"| {r['confidence']} | {r['proposals']} | {r['accepted']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(setup=vars(args), bins=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
