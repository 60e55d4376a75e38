"""How often prompt-lookup proposals are accepted, by the length of the match behind them.

Runs specbatch.generate with every row drafting its whole limit (policy fixed; a
lookup-first draft then proposes the lookup's token wherever 2+ tokens match, with confidence 1),
writes a round trace, and for every proposal of confidence >= 0.99 whose earlier proposals were all
accepted finds the longest n (up to 8) for which the row's last n tokens occurred earlier in its
text, and whether every earlier occurrence was followed by the same token. --head also runs the
feature head from scratch on the target's features (fast.drafts.feature_draft) at each such proposal and
splits the table by whether the head's own greedy token is the lookup's.

    python benchmarks/lookup_acceptance.py --target smollm2 --draft smollm2-head+lookup \
        --prompts question.jsonl --per-category 1 --chat-template [--batch-size 13] [--head smollm2-head]
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict


def longest_match(seq: list) -> tuple[int, list]:
    """(n, followers): the longest n <= 8 whose last-n-token suffix occurred earlier in seq, and the
    token after each earlier occurrence."""
    for n in range(8, 0, -1):
        if len(seq) < n + 1:
            continue
        tail = seq[-n:]
        followers = [seq[j + 1] for j in range(n - 1, len(seq) - 1) if seq[j - n + 1:j + 1] == tail]
        if followers:
            return n, followers
    return 0, []


def lookup_proposals(trace_path, head=None, target=None) -> list[dict]:
    """Every reached proposal of confidence >= 0.99: its match length, whether the followers agree,
    whether it was accepted, and (head given) whether the head's greedy token is the same."""
    import torch
    out = []
    with open(trace_path) as f, torch.inference_mode():
        for line in f:
            for row in json.loads(line).get("rows", []):
                content = row["tokens"][:row["content_len"]]
                reached = [d for d in range(int(row["draft_limit"])) if row["accepted"] >= d and d < len(row["drafted"])]
                if not any(row["draft_confidence"][d] >= 0.99 for d in reached):
                    continue
                feature = token = None
                if head is not None:  # the target's feature before the row's last token, then estimates
                    feature = target.model(input_ids=torch.tensor([content[:-1]])).last_hidden_state[0, -1]
                    token = content[-1]
                seq = list(content)
                for d in reached:
                    proposal = row["drafted"][d]
                    agrees = None
                    if head is not None:
                        step = head(input_ids=torch.tensor([[token]]), features=feature[None, None], logits_to_keep=1)
                        agrees = int(step.logits[0, -1].argmax()) == proposal
                        feature, token = step.features[0, -1], proposal
                    if row["draft_confidence"][d] >= 0.99:
                        n, followers = longest_match(seq)
                        out.append(dict(n=n, consistent=len(set(followers)) == 1, agrees=agrees,
                                        accepted=row["accepted"] > d))
                    seq.append(proposal)
    return out


def main() -> None:
    from draft_calibration import add_run_arguments, drafting_trace

    from specbatch.fast.loading import load_draft

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(p)  # --draft: a lookup-first draft (...+lookup)
    p.add_argument("--head", default=None, help="a feature draft to compare with (e.g. smollm2-head)")
    args = p.parse_args()
    with drafting_trace(args) as (target, trace, ids):
        head = load_draft(args.head, target, "float32", "cpu")[0] if args.head else None
        proposals = lookup_proposals(trace, head, target)
    groups = defaultdict(list)
    for x in proposals:
        length = f"{min(x['n'], 5)}{'+' if x['n'] >= 5 else ''}"
        groups[("all", length)].append(x["accepted"])
        groups[("followers " + ("agree" if x["consistent"] else "differ"), length)].append(x["accepted"])
        if x["agrees"] is not None:
            groups[("head " + ("agrees" if x["agrees"] else "disagrees"), length)].append(x["accepted"])
    print(f"{len(proposals)} lookup proposals reached (confidence >= 0.99), {len(ids)} prompts")
    print("| proposals | longest match | count | accepted |\n|---|---|---|---|")
    for (kind, length), accepted in sorted(groups.items()):
        print(f"| {kind} | {length} | {len(accepted)} | {sum(accepted) / len(accepted):.3f} |")


if __name__ == "__main__":
    main()
