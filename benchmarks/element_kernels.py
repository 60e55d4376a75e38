"""The native element-wise kernels against torch's operators, one step at a time.

Times fast.compute.native's rms_norm, rotate and silu_mul against the same steps by torch's
operators (fast.compute.lean_llama.TorchOps) at SmolLM2-135M's shapes (hidden 576, MLP 1,536, 9 query
and 3 key/value heads of 64) for a few row counts, alternating the two, the fastest of REPEATS
batches of calls each. A calibration before and after says whether the run may be quoted.

    python benchmarks/element_kernels.py --out docs/results/element-kernels [--rows 1,13,52,512]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from specbatch.cli import calibration
from specbatch.cli.machine import describe_machine
from specbatch.fast.compute import native
from specbatch.fast.compute.lean_llama import TORCH_OPS

HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64
REPEATS = 15


def fastest_us(step, calls: int) -> float:
    """The fastest of REPEATS batches of `calls` calls, in µs per call."""
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def steps(ops, rows: int, dtype):
    """The three steps of a block on `ops`, as zero-argument calls over fixed inputs of `rows` rows."""
    generator = torch.Generator().manual_seed(rows)
    randn = lambda *shape: torch.randn(*shape, generator=generator).to(dtype)  # noqa: E731
    hidden, weight = randn(1, rows, HIDDEN), randn(HIDDEN)
    qkv = randn(1, rows, HEADS + 2 * KV_HEADS, HEAD_DIM)
    cos, signed_sin = randn(1, rows, 1, HEAD_DIM), randn(1, rows, 1, HEAD_DIM)
    gate_up = randn(1, rows, 2 * MLP)
    return {"rms norm": lambda: ops.rms_norm(hidden, weight, 1e-5),
            "rotation": lambda: ops.rotate(qkv[:, :, :HEADS + KV_HEADS], cos, signed_sin),
            "SiLU product": lambda: ops.silu_mul(gate_up)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,13,52,512")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", required=True, help="a folder: results.json and results.md")
    args = ap.parse_args()
    kernels = native.extension()
    if kernels is None:
        sys.exit("error: the native extension cannot be built here (see the warning above)")
    before = calibration.calibrate()
    rows_out = []
    with torch.inference_mode():
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            for rows in (int(r) for r in args.rows.split(",")):
                calls = max(5, 2000 // rows)
                ours, theirs = steps(kernels, rows, dtype), steps(TORCH_OPS, rows, dtype)
                for name in ours:
                    times = {"kernel": [], "torch": []}
                    for turn in range(4):  # alternating, the order swapped every turn
                        for side in (("kernel", "torch") if turn % 2 else ("torch", "kernel")):
                            times[side].append(fastest_us(ours[name] if side == "kernel" else theirs[name], calls))
                    rows_out.append(dict(dtype=dtype_name, rows=rows, step=name, kernel_us=min(times["kernel"]),
                                         torch_us=min(times["torch"])))
                    print(f"{dtype_name} {rows} rows {name}: kernel {rows_out[-1]['kernel_us']:.1f} µs, torch "
                          f"{rows_out[-1]['torch_us']:.1f} µs", file=sys.stderr, flush=True)
    after = calibration.calibrate()
    judged = calibration.verdict(before, after)
    report = dict(command=" ".join(["python", *sys.argv]), machine=describe_machine(),
                  flags=native.compile_flags(), calibration_before=before, calibration_after=after,
                  verdict=judged, rows=rows_out)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"`{report['command']}`", "", f"Machine: {report['machine']['summary']}; built with "
             f"`{' '.join(report['flags'])}`.", "", calibration.describe(before, after, judged), "",
             "| dtype | rows | step | kernel (µs) | torch's operators (µs) | torch / kernel |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['rows']} | {r['step']} | {r['kernel_us']:.1f} | {r['torch_us']:.1f} | "
              f"{r['torch_us'] / r['kernel_us']:.2f}x |" for r in rows_out]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
