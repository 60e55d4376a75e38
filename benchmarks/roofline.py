"""The floor of a decoding step on this machine, and specbatch's step beside it.

Measures, in one run:
- the memory read bandwidth (a sum over a 512 MB float32 tensor, far larger than any cache);
- the linear products of one step alone (SmolLM2-135M's shapes: 30 layers of q, k, v, o, gate, up,
  down, and the 49,152-row head; random weights) at each row count, in float32 and bfloat16, with
  torch's plain F.linear and with the oneDNN-prepacked kernel the engine uses on CPU;
- the per-op overhead: one tiny element-wise op, and one tiny linear, timed in a loop;
- row invariance: for each product of the engine's forward, up to how many rows every row of the
  prepacked product is bitwise its one-row product, in float32 and bfloat16;
- specbatch's own target-only decode step on SmolLM2 (warm, `generate`, ragged, all rows live): the
  marginal cost of one more token per row (generations of 2 and of --new-tokens tokens, alternating,
  the difference of their totals over the steps between them), at batch 1 and 13, in float32 and bfloat16
  (--engine-dtypes), and its ratio to the products alone in the same dtype, with the faster of the
  two kernels the engine chooses between at that row count.
Every product figure is the fastest of its repeats (a machine only slows a pass down); the engine's
step is the median of its runs. A calibration before and after says whether the run may be quoted
(specbatch.cli.calibration).

    python benchmarks/roofline.py --out docs/results/roofline [--rows 1,2,4,8,13,16,32,52,64] [--no-engine]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specbatch.cli import calibration
from specbatch.cli.machine import describe_machine


def bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def per_op_us(repeats: int = 2000) -> dict:
    """Microseconds per call of a tiny add, a tiny F.linear and a tiny prepacked linear."""
    a, w = torch.randn(1, 64), torch.randn(64, 64)
    out = {}
    with torch.inference_mode():
        out["add"] = 1e6 * statistics.median(_timed(lambda: [a + a for _ in range(100)]) for _ in range(repeats // 100)) / 100
        out["linear"] = 1e6 * statistics.median(_timed(lambda: [F.linear(a, w) for _ in range(100)])
                                                for _ in range(repeats // 100)) / 100
        from specbatch.fast.compute.kernels import available
        if available():
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            out["prepacked_linear"] = 1e6 * statistics.median(_timed(lambda: [torch.ops.mkldnn._linear_pointwise(
                a, packed, None, "none", [], "") for _ in range(100)]) for _ in range(repeats // 100)) / 100
    return {k: round(v, 2) for k, v in out.items()}


def prepacked_step(weights, rows: int, repeats: int = 7) -> float | None:
    from specbatch.fast.compute.kernels import available
    if not available():
        return None
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    except RuntimeError:  # oneDNN does not take this dtype on this CPU (bfloat16 without AVX-512 or AVX-NE)
        return None
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(w.dtype) for w in weights}

    def once():
        with torch.inference_mode():
            for w, p in zip(weights, packed):
                torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")
    once()
    return min(_timed(once) for _ in range(repeats))


def products_table(rows_list, repeats: int) -> list[dict]:
    table = []
    for dtype in (torch.float32, torch.bfloat16):
        weights = calibration.step_weights(dtype=dtype)
        head = weights[-1:]
        for rows in rows_list:
            plain = calibration.time_products(weights, rows, repeats)
            packed = prepacked_step(weights, rows, repeats)
            head_packed = prepacked_step(head, rows, repeats)
            table.append(dict(dtype=str(dtype).removeprefix("torch."), rows=rows, plain_ms=round(1000 * plain, 2),
                              prepacked_ms=None if packed is None else round(1000 * packed, 2),
                              head_prepacked_ms=None if head_packed is None else round(1000 * head_packed, 2)))
            print(f"{table[-1]}", file=sys.stderr, flush=True)
    return table


ENGINE_SHAPES = {"q, k, v (fused)": (576 + 2 * 192, 576), "o": (576, 576), "gate, up (fused)": (2 * 1536, 576),
                 "down": (576, 1536), "head": (49152, 576)}  # the products of the engine's lean SmolLM2 forward


def row_invariant_up_to(out_features: int, in_features: int, dtype, max_rows: int = 64) -> int:
    """The largest n such that, for every row count up to n, each row of the prepacked product is
    bitwise equal to that row's product alone (0: oneDNN does not take the dtype here). Where the
    products of every layer stay row-invariant, a verify of n tokens rounds each token as a decode
    step does, and speculation reproduces target-only decoding bitwise, ties included."""
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(out_features, in_features, generator=g) * in_features ** -0.5).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    except RuntimeError:
        return 0
    x = torch.randn(max_rows, in_features, generator=g).to(dtype)
    with torch.inference_mode():
        product = lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")  # noqa: E731
        alone = torch.cat([product(x[i:i + 1]) for i in range(max_rows)])
        for n in range(2, max_rows + 1):
            if not torch.equal(product(x[:n]), alone[:n]):
                return n - 1
    return max_rows


def row_invariance() -> list[dict]:
    return [dict(product=name, shape=list(shape), **{str(d).removeprefix("torch."): row_invariant_up_to(*shape, d)
                                                     for d in (torch.float32, torch.bfloat16)})
            for name, shape in ENGINE_SHAPES.items()]


def engine_steps(batches, new_tokens: int, repeats: int, dtype: str = "float32") -> list[dict]:
    """specbatch's target-only decode step on SmolLM2 (ragged, in `dtype`) at each batch size: the
    first `batch` of the 13 shipped prompts, chat template, EOS off. A step is the marginal cost of
    one more token per row: generations of 2 and of `new_tokens` tokens alternate, and the step is
    the difference of their median totals over the new_tokens - 2 steps between them, so that the
    prefill and what a generation pays once (its caches, its plans) are not spread over the steps."""
    import specbatch
    from specbatch.cli.bench import SHIPPED_PROMPTS, select_prompts
    from specbatch.prepare import encode_prompts
    from specbatch.cli.bench import prepare_kernels
    from specbatch.options import defaults
    target, _, tokenizer = specbatch.load("smollm2", dtype=dtype)
    prepare_kernels(target, None, defaults())
    ids = encode_prompts([t for _, t in select_prompts(SHIPPED_PROMPTS)], tokenizer, True)
    rows = []
    for batch in batches:
        totals = {2: [], new_tokens: []}
        for repeat in range(repeats + 1):  # the first repeat warms up
            for tokens in ((2, new_tokens) if repeat % 2 else (new_tokens, 2)):
                r = specbatch.generate(target, None, ids[:batch], max_new_tokens=tokens, batch_size=batch,
                                       eos_token_id=[])
                if repeat:
                    totals[tokens].append(r.stats["time_total"])
        short, long = statistics.median(totals[2]), statistics.median(totals[new_tokens])
        step = (long - short) / (new_tokens - 2)
        rows.append(dict(dtype=dtype, batch=batch, step_ms=round(1000 * step, 2),
                         runs_ms=[round(1000 * (b - a) / (new_tokens - 2), 2)
                                  for a, b in zip(totals[2], totals[new_tokens])]))
        print(f"{rows[-1]}", file=sys.stderr, flush=True)
    return rows


def floor_ms(row: dict) -> float:
    """The products of a step with the faster of the two kernels the engine chooses between
    (fast.compute.kernels: torch's product, or the prepacked one): the floor a step is measured against."""
    return min(x for x in (row["plain_ms"], row["prepacked_ms"]) if x is not None)


def markdown(report: dict) -> str:
    lines = [f"Machine: {report['machine']['summary']}", f"Command: `{report['command']}`", "",
             calibration.describe(report["calibration_before"], report["calibration_after"], report["verdict"]), "",
             f"Memory read bandwidth: {report['bandwidth_gbs']:.1f} GB/s (float32 weights of SmolLM2-135M, "
             f"538 MB: {538e6 / report['bandwidth_gbs'] / 1e6:.1f} ms per pass)", "",
             "Per-op overhead (µs per call): " + ", ".join(f"{k} {v}" for k, v in report["per_op_us"].items()), "",
             "| dtype | rows | products, F.linear (ms) | products, prepacked (ms) | of which the head, prepacked (ms) |",
             "|---|---|---|---|---|"]
    for r in report["products"]:
        packed = [("not on this CPU" if r[k] is None else r[k]) for k in ("prepacked_ms", "head_prepacked_ms")]
        lines.append(f"| {r['dtype']} | {r['rows']} | {r['plain_ms']} | {packed[0]} | {packed[1]} |")
    if report.get("row_invariance"):
        lines += ["", "Row invariance of the prepacked products (the largest n such that every row count up to n "
                  "gives each row bitwise its one-row product):", "",
                  "| product | shape | float32 | bfloat16 |", "|---|---|---|---|"]
        lines += [f"| {r['product']} | {r['shape'][0]} x {r['shape'][1]} | up to {r['float32']} | "
                  f"up to {r['bfloat16']} |" for r in report["row_invariance"]]
    if report.get("engine"):
        floors = {(r["dtype"], r["rows"]): floor_ms(r) for r in report["products"]}
        lines += ["", "| dtype | batch | specbatch decode step (ms) | products, the faster kernel (ms) | step / products |",
                  "|---|---|---|---|---|"]
        for r in report["engine"]:
            dtype = r.get("dtype", "float32")
            floor = floors.get((dtype, r["batch"]))
            ratio = f"{r['step_ms'] / floor:.2f}x" if floor else "-"
            lines.append(f"| {dtype} | {r['batch']} | {r['step_ms']} | {floor} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,13,16,32,52,64")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--engine-batches", default="1,13")
    ap.add_argument("--new-tokens", type=int, default=33)
    ap.add_argument("--engine-dtypes", default="float32,bfloat16")
    ap.add_argument("--no-engine", action="store_true", help="the products only (no SmolLM2 download)")
    ap.add_argument("--out", required=True, help="a folder: roofline.json and roofline.md")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    before = calibration.calibrate()
    report = dict(machine=describe_machine(), command="python benchmarks/roofline.py " + " ".join(sys.argv[1:]),
                  calibration_before=before, bandwidth_gbs=round(bandwidth_gbs(), 2), per_op_us=per_op_us(),
                  products=products_table([int(x) for x in args.rows.split(",")], args.repeats),
                  row_invariance=row_invariance())
    if not args.no_engine:
        report["engine"] = [step for dtype in args.engine_dtypes.split(",") for step in engine_steps(
            [int(x) for x in args.engine_batches.split(",")], args.new_tokens, max(2, args.repeats // 3), dtype)]
    report["calibration_after"] = calibration.calibrate()
    report["verdict"] = calibration.verdict(before, report["calibration_after"])
    (out / "roofline.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "roofline.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
