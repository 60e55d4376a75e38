"""Whether a timing can be quoted: a calibration figure before and after, and the machine's load.

A benchmark on a shared machine can run 3-10x slower than on a quiet one, and nothing in its own
figures says so. `calibrate()` times a fixed piece of work, the linear products of four decoder
layers of SmolLM2-135M's shapes at 8 rows in float32 (53 MB of random weights, past any cache, so
that memory bandwidth counts as in a real step; the figure depends on the machine, never on a
download; about 0.3 s), and `verdict(before, after)` flags a run whose two calibrations
differ by more than 10%, or where other processes kept more than half the cores busy: the 1-minute
load average less the benchmark's own threads (which it keeps busy itself) above cores / 2. A
flagged run is recorded with its reasons and not quoted (bench prints it in its report).
"""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

# SmolLM2-135M: 30 layers, hidden 576, 9 query and 3 key/value heads of 64, MLP 1,536, a tied head
# of 49,152 rows
SHAPES = dict(layers=30, hidden=576, kv=192, intermediate=1536, vocab=49152)
CALIBRATION_SHAPES = dict(SHAPES, layers=4, vocab=0)  # four layers, no head
ROWS = 8
DRIFT_LIMIT = 0.10
OTHERS_LIMIT = 0.5  # the share of the cores other processes may keep busy


def step_weights(shapes: dict = SHAPES, dtype=torch.float32, seed: int = 0) -> list[torch.Tensor]:
    """Random weights of one decoder step's linear products: per layer q, k, v, o, gate, up, down,
    then the output head ([out, in] each, as nn.Linear holds them)."""
    g = torch.Generator().manual_seed(seed)
    h, kv, i = shapes["hidden"], shapes["kv"], shapes["intermediate"]
    layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]
    shapes_all = layer * shapes["layers"] + ([(shapes["vocab"], h)] if shapes["vocab"] else [])
    return [(torch.randn(out, inp, generator=g) * inp ** -0.5).to(dtype) for out, inp in shapes_all]


def products_step(weights: list[torch.Tensor], rows: int) -> float:
    """Seconds for one pass of `rows` rows through every weight (each product's input of its own width)."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(w.dtype) for w in weights}
    start = time.perf_counter()
    with torch.inference_mode():
        for w in weights:
            F.linear(inputs[w.shape[1]], w)
    return time.perf_counter() - start


def time_products(weights, rows: int, repeats: int = 21) -> float:
    """The fastest of `repeats` passes, after one warm-up pass (a machine only ever slows a pass down:
    on a quiet machine the minimum varies by about 3% from call to call, the median by 15%)."""
    products_step(weights, rows)
    return min(products_step(weights, rows) for _ in range(repeats))


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # not on this platform
        return None


def calibrate(repeats: int = 21) -> dict:
    """The calibration figure now: the products of CALIBRATION_SHAPES at ROWS rows (ms), and the load average."""
    weights = step_weights(CALIBRATION_SHAPES)
    ms = 1000 * time_products(weights, ROWS, repeats)
    return dict(step_ms=round(ms, 3), rows=ROWS, shapes="4 layers of SmolLM2-135M, float32", load_average=load_average(),
                cores=os.cpu_count(), threads=torch.get_num_threads())


def others_load(c: dict) -> float | None:
    """The load of other processes: the 1-minute load average less the benchmark's own threads."""
    return None if c["load_average"] is None else max(0.0, c["load_average"] - c.get("threads", 1))


def verdict(before: dict, after: dict) -> dict:
    """{quotable, drift, reasons}: not quotable when the two calibrations differ by more than
    DRIFT_LIMIT, or other processes' load (others_load) exceeds OTHERS_LIMIT of the cores."""
    drift = abs(after["step_ms"] - before["step_ms"]) / min(before["step_ms"], after["step_ms"])
    reasons = []
    if drift > DRIFT_LIMIT:
        reasons.append(f"calibration drifted {100 * drift:.0f}% ({before['step_ms']:.1f} -> {after['step_ms']:.1f} ms)")
    for when, c in (("before", before), ("after", after)):
        others = others_load(c)
        if others is not None and others > OTHERS_LIMIT * c["cores"]:
            reasons.append(f"load average {c['load_average']:.2f} {when}: other processes kept {others:.2f} of the "
                           f"{c['cores']} cores busy")
    return dict(quotable=not reasons, drift=round(drift, 4), reasons=reasons)


def describe(before: dict, after: dict, judged: dict) -> str:
    """One line for a report."""
    state = "quotable" if judged["quotable"] else "NOT QUOTABLE: " + "; ".join(judged["reasons"])
    load = "/".join("-" if c["load_average"] is None else f"{c['load_average']:.2f}" for c in (before, after))
    return (f"Calibration (linear products, {before['rows']} rows, {before['shapes']}): {before['step_ms']:.2f} ms "
            f"before, {after['step_ms']:.2f} ms after (drift {100 * judged['drift']:.1f}%), load average {load} on "
            f"{before['cores']} cores: {state}")
