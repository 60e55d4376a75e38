"""The native block loop against the Python one, side by side in one run (fast.compute.native).

For each batch size and method (target-only decoding, and speculation with --draft), runs the
engine with native=True and native=False in turn, the order alternating between repeats, and
reports tokens per second, the target's mean forward per round (time_verify / rounds: a decoding
step for target-only, a verify for speculation), the Python/native ratio of each, whether the two
produced the same tokens, and every output judged against target-only decoding at batch 1 (bitwise
equal, else its first divergence a floating-point tie or an error by the ulp rule:
specbatch.cli.bench.Judge). The native loop is bitwise the Python one, so a difference between the
two can only come from the run: the goodput policy drafts by measured costs, so two runs may verify
different numbers of tokens, and in bfloat16 a product's rounding depends on its row count beyond
the rows where the kernel is row-invariant (a tie may then go either way). A calibration
before and after says whether the run may be quoted (specbatch.cli.calibration). Models load once;
every run is warm.

    python benchmarks/native_ab.py --target smollm2 --draft smollm2-head+lookup --chat-template \
        --prompts question.jsonl --per-category 1 --batch-sizes 1,13 --repeats 3 --out docs/results/native
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


def timed(target, draft, ids, batch: int, new: int, native: bool) -> dict:
    start = time.perf_counter()
    result = generate(target, draft, ids, max_new_tokens=new, batch_size=batch, native=native)
    seconds = time.perf_counter() - start
    stats = result.stats
    return dict(tokens_per_second=stats["generated_tokens"] / seconds,
                forward_ms=1000 * stats["time_verify"] / stats["rounds"], sequences=result.sequences)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--draft", default="smollm2-head+lookup", help="'none': target-only decoding only")
    p.add_argument("--prompts", default=str(SHIPPED_PROMPTS))
    p.add_argument("--per-category", type=int, default=0)
    p.add_argument("--chat-template", action="store_true")
    p.add_argument("--batch-sizes", default="1,13")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--out", required=True, help="folder for results.json and results.md")
    p.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    args = p.parse_args()
    out = Path(args.out)
    if (out / "results.json").exists() and not args.overwrite:
        sys.exit(f"error: {out / 'results.json'} exists; pass --overwrite to replace it")
    from specbatch.fast.compute import native
    if native.extension() is None:
        sys.exit("error: the native block loop cannot be built here, so there is nothing to compare")
    target, tokenizer = load_model(args.target, args.dtype)
    draft = None if args.draft == "none" else load_draft(args.draft, target)[0]
    texts = [text for _, text in select_prompts(args.prompts, args.per_category)]
    ids = encode_prompts(texts, tokenizer, args.chat_template)
    from specbatch.cli.bench import prepare_kernels
    from specbatch.options import defaults
    prepare_kernels(target, draft, defaults())
    methods = [("target-only", None)] + ([("speculative", draft)] if draft is not None else [])
    from specbatch.cli.bench import Judge, agreement, least_agreeing
    reference = generate(target, None, ids, max_new_tokens=args.max_new_tokens, batch_size=1).sequences
    judge = Judge(target, ids, reference, greedy=True)
    before = calibration.calibrate()
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        for method, model in methods:
            for native_on in (True, False):
                timed(target, model, ids, batch, args.max_new_tokens, native_on)  # warm: buffers of full size
            runs = {True: [], False: []}
            for repeat in range(args.repeats):
                for native_on in ((True, False) if repeat % 2 == 0 else (False, True)):
                    runs[native_on].append(timed(target, model, ids, batch, args.max_new_tokens, native_on))
            median = lambda key, on: statistics.median(r[key] for r in runs[on])  # noqa: E731
            row = dict(batch=batch, method=method,
                       native_tokens_per_second=median("tokens_per_second", True),
                       python_tokens_per_second=median("tokens_per_second", False),
                       native_forward_ms=median("forward_ms", True), python_forward_ms=median("forward_ms", False),
                       speedups=[n["tokens_per_second"] / p["tokens_per_second"]
                                 for n, p in zip(runs[True], runs[False])],
                       same_tokens=all(n["sequences"] == p["sequences"] for n, p in zip(runs[True], runs[False])),
                       native_exact=agreement(least_agreeing([judge(r["sequences"]) for r in runs[True]]), len(ids)),
                       python_exact=agreement(least_agreeing([judge(r["sequences"]) for r in runs[False]]), len(ids)))
            rows.append(row)
            print(f"batch {batch} {method}: native {row['native_forward_ms']:.1f} ms, python "
                  f"{row['python_forward_ms']:.1f} ms a forward", file=sys.stderr, flush=True)
    after = calibration.calibrate()
    judged = calibration.verdict(before, after)
    report = dict(command=" ".join(sys.argv), machine=describe_machine(), calibration_before=before,
                  calibration_after=after, verdict=judged, rows=rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"`{report['command']}`", "", f"Machine: {report['machine']['summary']}.", "",
             calibration.describe(before, after, judged), "",
             "| batch | method | target forward, Python (ms) | native (ms) | tokens/s, Python | native | "
             "native / Python (each repeat) | same tokens | exact, native | exact, Python |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['method']} | {r['python_forward_ms']:.1f} | {r['native_forward_ms']:.1f} | "
              f"{r['python_tokens_per_second']:.1f} | {r['native_tokens_per_second']:.1f} | "
              f"{', '.join(f'{s:.2f}x' for s in r['speedups'])} | {'yes' if r['same_tokens'] else 'no'} | "
              f"{r['native_exact']['exact']} | {r['python_exact']['exact']} |"
              for r in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
