"""Exact-match reports: where a sequence first differs from the reference, and whether that is a
floating-point tie or an algorithmic error.

A divergence is a tie when, at that position, the reference's logit for its own token exceeds its
logit for the candidate's token by no more than the rounding noise of the forward pass. That noise
scales with the precision and with the size of the vectors whose products make the logits (the
last hidden state and the head's rows), not with the top logit itself: a logit is h . w_t, and
rounding h moves every logit by about eps x |h| x |w_t|. The largest |logit| of the row is the
yardstick of that size the logits themselves give, so the rule counts ulps of the model's dtype at it:

    tie  <=>  logit[reference token] - logit[candidate token] <= ulps x ulp(max_t |logit[t]|)

(Measured in bfloat16 on SmolLM2: where the top logit was 2.0 and the row's largest |logit| 39.75,
batch 13 and batch 1 rounded the top two tokens 0.16 apart, 10 ulps at the top logit but under 1
at 39.75; in float32 the two tokens were 0.04 apart.)

with a default per dtype (`TIE_ULPS`). float32 and float64 accumulate long dot products in their
own precision, and a different batch shape or kernel changes the summation order: logits move by
tens to hundreds of ulps (1e-5 to 1e-4 at logits near 20 in float32 on this CPU), hence 512.
bfloat16 and float16 products accumulate in float32 on this CPU and only the roundings of their
outputs show: a few ulps (one bfloat16 ulp at 20 is 0.125), hence 4. An absolute tolerance can
still be given instead (`tolerance=`).
"""
from __future__ import annotations

import math

import torch

from .compute.cache import rect_inputs
from .models import ModelRunner, mask_fill_value

TIE_ULPS = {torch.float64: 4096, torch.float32: 512, torch.bfloat16: 4, torch.float16: 4}
# The largest tolerance a user may ask for: 16 times the default. The default already covers the
# rounding noise measured here several times over; a wider one would call a real preference of the
# model (a margin the dtype resolves) a tie, and a checker that can be told so passes wrong engines.
TIE_ULPS_CAP = {dtype: 16 * ulps for dtype, ulps in TIE_ULPS.items()}


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` numbers at |value| (at least the spacing at 1)."""
    exponent = math.floor(math.log2(abs(value))) if value else 0
    return torch.finfo(dtype).eps * 2.0 ** max(exponent, 0)


def next_logits(model, prefix: list[int]) -> torch.Tensor:
    """The model's next-token logits after `prefix` (batch 1, no padding), as float64."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    pos, mask = rect_inputs(torch.zeros(1, dtype=torch.long, device=device), 0, len(prefix), None, dtype,
                            mask_fill_value(dtype))
    return ModelRunner(model)(torch.tensor([prefix], device=device), pos, mask, None, last_only=True)[0, -1].double()


def first_divergence(got: list[int], want: list[int]) -> int | None:
    for j, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return j
    return None if len(got) == len(want) else min(len(got), len(want))


def compare(model, prompts, sequences, references, tolerance: float | None = None, ulps: float | None = None
            ) -> list[dict]:
    """One report per request: exact, or the first divergence and its verdict.

    At the divergence the report gives the reference's top-2 margin (`margin`) and the gap between
    the reference's token and the candidate's token (`gap`, equal to the margin when the candidate
    took the runner-up); the verdict is a tie when the gap is within the threshold, an algorithmic
    error otherwise. Where one sequence simply ends earlier (EOS or length), the margin is used.
    threshold: `tolerance` (absolute) if given, else `ulps` (default TIE_ULPS of the model's dtype)
    ulps of the dtype at the row's largest |logit|; `margin_ulps` and `gap_ulps` give both in those units."""
    dtype = next(model.parameters()).dtype
    ulps = TIE_ULPS.get(dtype, 4) if ulps is None else ulps
    reports = []
    for i, (prompt, got, want) in enumerate(zip(prompts, sequences, references)):
        got, want = list(got), list(want)
        j = first_divergence(got, want)
        if j is None:
            reports.append(dict(request=i, exact=True))
            continue
        logits = next_logits(model, list(prompt) + want[:j])
        top = logits.topk(2).values
        margin = float(top[0] - top[1])
        gap = float(logits[want[j]] - logits[got[j]]) if j < len(got) and j < len(want) else margin
        spacing = ulp(float(logits.abs().max()), dtype)
        threshold = tolerance if tolerance is not None else ulps * spacing
        reports.append(dict(request=i, exact=False, index=j, margin=margin, gap=gap, margin_ulps=margin / spacing,
                            gap_ulps=gap / spacing, threshold=threshold, kind="tie" if gap <= threshold else "error"))
    return reports
