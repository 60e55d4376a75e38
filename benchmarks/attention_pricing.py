"""The engine's attention with its measured kernel and group price, against the constant it replaced.

In one process, alternating (the order reversed every second repeat): target-only decoding of the
shipped prompts at each batch size, once with the attention's kernel and price of a row group
measured on this machine (fast.compute.attention_cost, the default) and once with plain matmuls
and a fixed price of 256 row-slots (what the engine used before). Prints the decode step (ms) of
each, their ratio per repeat, whether both gave the same tokens, and the calibration verdict.

    python benchmarks/attention_pricing.py --out docs/results/attention-pricing [--batch-sizes 1,13] [--repeats 4]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import specbatch
from specbatch.cli import calibration
from specbatch.cli.bench import SHIPPED_PROMPTS, prepare_kernels, select_prompts
from specbatch.cli.machine import describe_machine
from specbatch.fast.compute import attention
from specbatch.options import defaults
from specbatch.prepare import encode_prompts

MEASURED = attention._measured_pricing


def fixed(modules):
    return False, 256.0


def step_ms(target, ids, batch: int, new_tokens: int) -> tuple[float, list]:
    result = specbatch.generate(target, None, ids[:batch], max_new_tokens=new_tokens, batch_size=batch, eos_token_id=[])
    return 1000 * (result.stats["time_total"] - result.stats["time_prefill"]) / (new_tokens - 1), result.sequences


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-sizes", default="1,13")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=33)
    args = ap.parse_args()
    target, _, tokenizer = specbatch.load("smollm2")
    prepare_kernels(target, None, defaults())
    ids = encode_prompts([t for _, t in select_prompts(SHIPPED_PROMPTS)], tokenizer, True)
    before = calibration.calibrate()
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        step_ms(target, ids, batch, args.new_tokens)  # warm up
        times, same = {"measured": [], "fixed": []}, True
        for repeat in range(args.repeats):
            order = ("measured", "fixed") if repeat % 2 == 0 else ("fixed", "measured")
            outputs = {}
            for name in order:
                attention._measured_pricing = MEASURED if name == "measured" else fixed
                ms, outputs[name] = step_ms(target, ids, batch, args.new_tokens)
                times[name].append(round(ms, 2))
            same &= outputs["measured"] == outputs["fixed"]
        attention._measured_pricing = MEASURED
        ratios = [round(f / m, 3) for f, m in zip(times["fixed"], times["measured"])]
        rows.append(dict(batch=batch, measured_ms=times["measured"], fixed_ms=times["fixed"],
                         fixed_over_measured=ratios, median_ratio=round(statistics.median(ratios), 3),
                         same_tokens=same))
        print(rows[-1], file=sys.stderr, flush=True)
    after = calibration.calibrate()
    verdict = calibration.verdict(before, after)
    from specbatch.fast.compute.attention_cost import pricing_of
    config = target.config
    report = dict(command="python benchmarks/attention_pricing.py " + " ".join(sys.argv[1:]),
                  machine=describe_machine(), calibration_before=before, calibration_after=after, verdict=verdict,
                  measured_pricing=pricing_of(config, "cpu", target.dtype), rows=rows)
    lines = [f"Machine: {report['machine']['summary']}", f"Command: `{report['command']}`", "",
             calibration.describe(before, after, verdict), "",
             f"Measured here: SDPA's kernel {'faster' if report['measured_pricing'][0] else 'slower'} than plain "
             f"matmuls; one more group costs {report['measured_pricing'][1]:.0f} row-slots.", "",
             "| batch | decode step, measured (ms) | decode step, fixed: plain, 256 (ms) | fixed / measured per repeat "
             "| median | same tokens |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {' '.join(map(str, r['measured_ms']))} | {' '.join(map(str, r['fixed_ms']))} | "
                     f"{' '.join(map(str, r['fixed_over_measured']))} | {r['median_ratio']}x | {r['same_tokens']} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
