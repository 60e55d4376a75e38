"""Packed prefill: new prompts' real tokens only, several prompts to a forward, no padding.

A left-padded rectangle would cost rows x longest prompt: 13 Spec-Bench prompts of 40-769 tokens
make 9,997 token positions for 2,246 real tokens. Here the
prompts are laid back to back in one sequence per pack (at most `PACK_TOKENS` tokens, a longer
prompt alone), with
- position ids restarting at 0 for each prompt (I2),
- a block-diagonal causal mask: a token of prompt s at content index q sees the tokens of prompt s
  at content indices 0..q (with a window W: the last W of them), nothing of another prompt (I4),
- each token's K/V written straight to its row's slot for its content index (I3: the same K/V an
  unpadded batch-1 prefill computes, since the token sees exactly the same prefix at the same
  positions).
Without a window the engine's attention computes each prompt of a pack causally on its own
(fast.compute.attention.segment_attention): no score across prompts or above the diagonal is
computed. With a window the pack's mask is applied whole, and the pack bound keeps the wasted
cross-prompt work small: a pack of T tokens computes T^2 scores where the prompts need the sum of
their squared lengths.
"""
from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache

from .slot_cache import SlotCache

PACK_TOKENS = 512


def plan_packs(lengths: list[int], budget: int | None = None) -> list[list[int]]:
    """Indices of the prompts in each pack, in order: consecutive prompts while they fit the budget
    (None: PACK_TOKENS as it is at the call, so that a caller may change it).

    Prompts of length 0 (nothing to prefill) are left out."""
    budget = PACK_TOKENS if budget is None else budget
    packs, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        if current and used + n > budget:
            packs.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        packs.append(current)
    return packs


def packed_inputs(contents: list[list[int]], window: int | None, dtype, fill: float, device):
    """(input ids [1, T], position ids [1, T], 4D additive mask [1, 1, T, T], segment [T]) of one pack."""
    ids = torch.tensor([[t for c in contents for t in c]], device=device)
    segment = torch.cat([torch.full((len(c),), s, device=device) for s, c in enumerate(contents)])
    position = torch.cat([torch.arange(len(c), device=device) for c in contents])
    visible = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])
    if window is not None:
        visible &= position[None, :] > position[:, None] - window
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, fill)
    return ids, position[None], mask[None, None], segment


def prefill_into(runner, cache: SlotCache, contents: list[list[int]], slot_rows: list[int], first_index: list[int],
                 settings, route=None) -> None:
    """Prefill `contents` (one token list per row) into `cache`: content index j of row i goes to slot
    row slot_rows[i], slot first_index[i] + j. Packs of at most PACK_TOKENS tokens, one forward each.

    I2 and I4 of each pack's positions and mask go to settings.observer.
    route(rows [1, T], index [1, T]) -> extra keyword arguments of the pack's forward, given each
    token's slot row and content index (fast.drafts.feature_draft: where the target's features go, and
    the features a feature draft reads)."""
    from ...invariants import check_packed_forward
    s = settings
    for pack in plan_packs([len(c) for c in contents]):
        ids, pos, mask, segment = packed_inputs([contents[i] for i in pack], s.window, s.dtype, s.fill, s.device)
        rows = torch.tensor([slot_rows[i] for i in pack], device=s.device)[segment]
        first = torch.tensor([first_index[i] for i in pack], device=s.device)[segment]
        cache.prepare_packed(rows[None], (first + pos[0])[None])
        s.observer.check(lambda: check_packed_forward(pos, mask, [len(contents[i]) for i in pack], s.window))
        extra = route(rows[None], pos) if route is not None else {}
        bounds = np.cumsum([0] + [len(contents[i]) for i in pack])
        segments = tuple(zip(bounds[:-1].tolist(), bounds[1:].tolist())) if s.window is None else None
        runner(ids, pos, mask, cache, last_only=True, segments=segments, **extra)


def prefill_rectangle(runner, contents: list[list[int]], width: int, settings) -> DynamicCache:
    """A left-padded cache [B, H, width, D] per layer holding each row's contents right-aligned
    (content j of row i at column width - len(contents[i]) + j), prefilled in packs; padding
    columns hold zeros that the rectangular masks never show."""
    buffer = SlotCache(runner.num_layers, len(contents), width, settings.device)
    prefill_into(runner, buffer, contents, list(range(len(contents))), [width - len(c) for c in contents],
                 settings)
    cache = DynamicCache()
    for index, layer in enumerate(buffer.layers):
        if layer.is_initialized:
            cache.update(layer.keys[:, :, :width].contiguous(), layer.values[:, :, :width].contiguous(), index)
    buffer.release()
    return cache
