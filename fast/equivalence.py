"""Exact-match reports: where a sequence first differs from the reference, and whether that is a
floating-point tie (top-2 logit margin of the reference below a tolerance) or an algorithmic error."""
from __future__ import annotations

import torch

from .cache import rect_inputs
from .models import ModelRunner, mask_fill_value


def top2_margin(model, prefix: list[int]) -> float:
    """Top-1 minus top-2 logit of the model's next-token distribution after `prefix` (batch 1)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    pos, mask = rect_inputs(torch.zeros(1, dtype=torch.long, device=device), 0, len(prefix), None, dtype,
                            mask_fill_value(dtype))
    logits = ModelRunner(model)(torch.tensor([prefix], device=device), pos, mask, None, last_only=True)
    top = logits[0, -1].double().topk(2).values
    return float(top[0] - top[1])


def first_divergence(got: list[int], want: list[int]) -> int | None:
    for j, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return j
    return None if len(got) == len(want) else min(len(got), len(want))


def compare(model, prompts, sequences, references, tolerance: float) -> list[dict]:
    """One report per request: exact, or the divergence index, the reference margin there and its kind."""
    reports = []
    for i, (prompt, got, want) in enumerate(zip(prompts, sequences, references)):
        j = first_divergence(list(got), list(want))
        if j is None:
            reports.append(dict(request=i, exact=True))
            continue
        margin = top2_margin(model, list(prompt) + list(want[:j]))
        reports.append(dict(request=i, exact=False, index=j, margin=margin,
                            kind="tie" if margin < tolerance else "error"))
    return reports
