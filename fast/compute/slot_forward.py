"""A forward over slot rows with per-row query indices: the ragged engine's, for target and draft alike.

Content index j of a slot row lives in cache slot j with position j (proofs_notes/ragged.md), so a
query at content index q has position q and sees slots 0..q (I2, I4), whatever its neighbours hold.
"""
from __future__ import annotations

import numpy as np
import torch

from ...invariants import check_mask, check_positions
from .attention import uses_engine_attention


def ragged_inputs(query_index: torch.Tensor, kv_len: int, window: int | None, dtype, fill: float):
    """Position ids [R, Q] and the 4D mask [R, 1, Q, kv_len]: query q sees slots 0..q (I2, I4)."""
    slot = torch.arange(kv_len, device=query_index.device)[None, None, :]
    q = query_index[:, :, None]
    visible = slot <= q
    if window is not None:
        visible &= slot > q - window
    mask = torch.zeros(visible.shape, dtype=dtype, device=query_index.device).masked_fill_(~visible, fill)
    return query_index.clamp(min=0), mask[:, None]


def slot_forward(runner, cache, query_index: np.ndarray, ids, settings, grouped: bool, last_only=False, **extra):
    """runner's forward over cache rows 0..R-1 at query_index [R, Q] (host; -1 pads a row's tail);
    grouped: the model runs the engine's attention (uses_engine_attention, asked once per engine).
    Returns (the runner's output, positions, mask); I2 and I4 of the forward go to settings.observer."""
    s = settings
    q = torch.as_tensor(query_index, device=s.device)
    cache.prepare(len(query_index), q, int(query_index.max()) + 1)  # host numpy: no device sync
    pos, mask = ragged_inputs(q, cache.kv_len, s.window, s.dtype, s.fill)
    s.observer.check(lambda: check_positions(pos, query_index) + check_mask(
        mask, query_index, np.broadcast_to(np.arange(cache.kv_len), (len(query_index), cache.kv_len)), s.window))
    # each row's visible length: the engine's attention (which groups rows by it) reads no further
    kv_lens = query_index.max(axis=1) + 1 if grouped else None
    return runner(ids, pos, mask, cache, last_only=last_only, kv_lens=kv_lens, **extra), pos, mask


def storage_dtype(runner, settings):
    """float32 K/V for a half-precision model whose attention is ours where the backend widens it
    (fast.compute.backend.wide_half_kv: on a CPU); otherwise the model's own dtype."""
    half = settings.dtype in (torch.bfloat16, torch.float16) and settings.backend.wide_half_kv
    return torch.float32 if half and uses_engine_attention(runner.model) else None
