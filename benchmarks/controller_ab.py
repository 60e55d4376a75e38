"""Proposal policies side by side in one process: named configurations, alternating.

Configurations (ragged, the default draft and options unless named):
  ar             target-only decoding (the baseline, same engine)
  goodput        the goodput policy (the default): proposal lengths priced from measured costs
  threshold      the threshold rule alone (draft_threshold, draft_floor)
  fixed          every row drafts k tokens every round
  NAME-kN        NAME with N draft tokens (e.g. goodput-k6, fixed-k1)
  threshold-T    the threshold rule with draft_threshold T (e.g. threshold-0.5)
Configurations alternate inside each repeat (in reverse order every second repeat), so machine drift
touches them alike; each line is one run, and `exact` counts outputs equal to the first run's. The
machine, a calibration before and after (specbatch.cli.calibration: whether the run may be quoted)
and each configuration's median tokens/s against `ar`'s (where it ran) close the report.

    python benchmarks/controller_ab.py --target smollm2 --prompts question.jsonl --per-category 1 \
        --chat-template --batch-size 13 --repeats 2 [--configs ar,goodput,threshold]
"""
from __future__ import annotations

import argparse
import re
import time

NAMED = {"ar": {}, "goodput": dict(policy="goodput"), "threshold": dict(policy="threshold"),
         "fixed": dict(policy="fixed")}
PARAMETRISED = {  # name pattern -> generate()'s options from its numbers
    r"(goodput|threshold|fixed)-k(\d+)": lambda name, n: dict(NAMED[name], num_draft_tokens=int(n)),
    r"threshold-([\d.]+)": lambda t: dict(policy="threshold", draft_threshold=float(t)),
}


def config_options(name: str) -> dict | None:
    """generate()'s options for a configuration name, None for an unknown name."""
    if name in NAMED:
        return dict(NAMED[name])
    for pattern, options in PARAMETRISED.items():
        match = re.fullmatch(pattern, name)
        if match:
            return options(*match.groups())
    return None


def main() -> None:
    import statistics

    from specbatch import generate
    from specbatch.cli import calibration
    from specbatch.cli.bench import select_prompts
    from specbatch.cli.machine import describe_machine
    from specbatch.fast.loading import load_draft, load_model
    from specbatch.prepare import encode_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default="smollm2-draft+lookup")
    p.add_argument("--prompts", required=True)
    p.add_argument("--per-category", type=int, default=0)
    p.add_argument("--chat-template", action="store_true")
    p.add_argument("--batch-size", type=int, default=13)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--configs", default="ar,goodput,threshold")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    names = [v.strip() for v in args.configs.split(",") if v.strip()]
    unknown = [v for v in names if config_options(v) is None]
    if unknown:
        p.error(f"unknown configuration {unknown[0]!r}; expected some of {', '.join(NAMED)}, NAME-kN or threshold-T")
    target, tokenizer = load_model(args.target, args.dtype)
    draft, _ = load_draft(args.draft, target, args.dtype)
    ids = encode_prompts([text for _, text in select_prompts(args.prompts, args.per_category)], tokenizer,
                         args.chat_template)
    reference, rates = None, {name: [] for name in names}
    before = calibration.calibrate()
    print("| repeat | config | batch | tokens/s | exact | rounds | lookup rounds | τ | draft s | verify s | prefill s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:  # drift cancels in pairs of repeats
            options = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, **config_options(name))
            start = time.perf_counter()
            result = generate(target, None if name == "ar" else draft, ids, **options)
            seconds = time.perf_counter() - start
            reference = reference or result.sequences
            s = result.stats
            exact = sum(a == b for a, b in zip(result.sequences, reference))
            rates[name].append(sum(map(len, result.sequences)) / seconds)
            print(f"| {repeat + 1} | {name} | {args.batch_size} | {sum(map(len, result.sequences)) / seconds:.1f} | "
                  f"{exact}/{len(ids)} | {s['rounds']} | {s['lookup_rounds']} | {s['mean_accepted_length']:.2f} | "
                  f"{s['time_draft']:.2f} | {s['time_verify']:.2f} | {s['time_prefill']:.2f} |", flush=True)
    after = calibration.calibrate()
    print(f"\n{describe_machine()['summary']}, {args.dtype}\n")
    print(calibration.describe(before, after, calibration.verdict(before, after)) + "\n")
    medians = {name: statistics.median(r) for name, r in rates.items()}
    print("| config | median tokens/s | vs ar |\n|---|---|---|")
    for name, rate in medians.items():
        print(f"| {name} | {rate:.1f} | {rate / medians['ar']:.2f}x |" if "ar" in medians else f"| {name} | {rate:.1f} | |")


if __name__ == "__main__":
    main()
