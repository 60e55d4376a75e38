"""How the engine's attention runs on this machine, measured for the model's shapes: which kernel
computes a part, and what one more part costs in slots read.

The engine's attention (fast.compute.attention) splits the rows of a forward into parts by visible
length, so that short rows do not read a long row's slots. Each part is one more call (gathering
its queries, two products, a softmax, scattering its outputs back); each row-slot read costs its
share of memory traffic. The split is worth it where the slots it saves cost more than the calls
it adds, so the planner needs the price of a call in slots: `group_cost`.

It differs several-fold between machines (a call cost 76 µs and a row-slot 84 ns on a 2-core AMD
EPYC VM, about 900 slots a call), so it is measured: the engine's flat attention is timed, one
query per row as in a decoding step, over parts of `rows` x `length` slots for a few shapes,
and a line seconds = call + slot x rows x length is fitted through the fastest of each; group_cost is
call / slot.

The kernel of a part is measured too: plain matmuls and a softmax, or SDPA's fused kernel. Which
is faster for the few queries per row of decoding and verifying differs between CPUs (plain was
faster on an Intel Xeon; SDPA took 45 µs against plain's 124 µs for one row of 100 slots on the
AMD EPYC VM), so both are timed over a few part shapes and the faster total wins. Both are
measured once per process for each (heads, kv heads, head size, dtype, device), in about 0.2 s.
"""
from __future__ import annotations

import functools
import time

import numpy as np
import torch

SHAPES = ((1, 32), (1, 512), (2, 1024), (4, 128), (8, 32), (8, 512), (13, 800))  # (rows, length) timed
KERNEL_SHAPES = ((1, 128, 1), (4, 512, 1), (13, 300, 1), (4, 256, 4))  # (rows, length, queries per row)
REPEATS = 15


def _fastest_seconds(fn, repeats: int, device) -> float:
    """The fastest of `repeats` timed calls after two warm-up calls: a busy machine only ever slows a
    call down, so the fastest is the estimate that other work disturbs least."""
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times[2:])


def sdpa_is_faster(heads: int, kv_heads: int, dim: int, dtype, device, repeats: int = REPEATS) -> bool:
    """Whether SDPA's kernel computes the KERNEL_SHAPES parts in less time than plain_attention."""
    from .attention import Plan, plain_attention, scoped_plan
    generator = torch.Generator(device="cpu").manual_seed(0)
    totals = {False: 0.0, True: 0.0}
    for rows, length, queries in KERNEL_SHAPES:
        query = torch.randn(rows, heads, queries, dim, generator=generator).to(device=device, dtype=dtype)
        key = torch.randn(rows, kv_heads, length, dim, generator=generator).to(device=device, dtype=dtype)
        value = torch.randn(rows, kv_heads, length, dim, generator=generator).to(device=device, dtype=dtype)
        mask = torch.zeros(rows, 1, queries, length, dtype=dtype, device=device)
        for sdpa in (False, True):
            with torch.inference_mode(), scoped_plan(Plan(sdpa=sdpa)):
                totals[sdpa] += _fastest_seconds(lambda: plain_attention(query, key, value, mask, dim ** -0.5),
                                                repeats, device)
    return totals[True] < totals[False]


def time_flat_part(rows: int, length: int, heads: int, kv_heads: int, dim: int, dtype, device,
                   repeats: int = REPEATS, sdpa: bool = False) -> float:
    """Median seconds of flat_attention over one part: `rows` rows with one query each at their
    last slot, `length` slots each; sdpa: computed by SDPA's kernel."""
    from .attention import Plan, flat_attention, flat_plan, scoped_plan
    generator = torch.Generator(device="cpu").manual_seed(0)
    query = torch.randn(1, heads, rows, dim, generator=generator).to(device=device, dtype=dtype)
    key = torch.randn(rows, kv_heads, length, dim, generator=generator).to(device=device, dtype=dtype)
    value = torch.randn(rows, kv_heads, length, dim, generator=generator).to(device=device, dtype=dtype)
    parts = flat_plan(np.arange(rows), np.full(rows, length - 1), None, dtype, float("-inf"), device)  # one part
    with torch.inference_mode(), scoped_plan(Plan(flat=parts, sdpa=sdpa)):
        return _fastest_seconds(lambda: flat_attention(query, key, value, dim ** -0.5), repeats, device)


def fit_group_cost(points: list[tuple[int, float]]) -> float:
    """call / slot of the line seconds = call + slot x row_slots fitted through (row_slots, seconds);
    at least one slot, and no more than the largest part measured where the slope is nil."""
    row_slots = np.array([x for x, _ in points], dtype=float)
    seconds = np.array([y for _, y in points], dtype=float)
    slot, call = np.polyfit(row_slots, seconds, 1)
    if slot <= 0:  # reading more slots cost nothing measurable: calls are all that count
        return float(row_slots.max())
    return float(min(max(call / slot, 1.0), row_slots.max()))


@functools.lru_cache(maxsize=None)
def pricing(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, device: str) -> tuple[bool, float]:
    """(whether SDPA's kernel computes the parts, one more part's cost in row-slots read) for these
    shapes on this machine."""
    where = torch.device(device)
    sdpa = sdpa_is_faster(heads, kv_heads, dim, dtype, where)
    points = [(rows * length, time_flat_part(rows, length, heads, kv_heads, dim, dtype, where, sdpa=sdpa))
              for rows, length in SHAPES]
    return sdpa, fit_group_cost(points)


def pricing_of(config, device, dtype) -> tuple[bool, float] | None:
    """pricing for a Hugging Face model's config (None where its attention shapes are unknown)."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if not heads or not dim or heads % kv_heads:
        return None
    return pricing(int(heads), int(kv_heads), int(dim), dtype, str(torch.device(device)))
