"""Masks, positions and cache edits for the rectangular (left-padded) layout, vectorized.

Everything is derived from per-row pad lengths (I1: pad_len + content_len = L), never from token
values. The realignment of the EQSPEC update is one gather per cache tensor
(reference.rounds.realign_source is its NumPy twin).
"""
from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import DynamicCache


def layout_index(pad_len: torch.Tensor, columns: int) -> torch.Tensor:
    """Content index held by each column of each row, [B, columns]; negative on padding."""
    return torch.arange(columns, device=pad_len.device)[None, :] - pad_len[:, None]


def rect_inputs(pad_len: torch.Tensor, first_col: int, num_cols: int, window: int | None, dtype, fill: float):
    """Position ids [B, Q] and the 4D additive mask [B, 1, Q, first_col + Q] for the query columns
    first_col .. first_col + Q - 1 of a left-padded batch whose cache covers [0, first_col).

    I2: position = content index (0 on pad queries, which nothing reads). I4: a query of content
    index q sees the slots holding content max(0, q - W + 1) .. q of its own row."""
    slot = layout_index(pad_len, first_col + num_cols)
    query = slot[:, first_col:]
    visible = (slot[:, None, :] >= 0) & (slot[:, None, :] <= query[:, :, None])
    if window is not None:
        visible &= slot[:, None, :] > query[:, :, None] - window
    mask = torch.zeros(visible.shape, dtype=dtype, device=pad_len.device).masked_fill_(~visible, fill)
    return query.clamp(min=0), mask[:, None]


def cache_layers(cache: DynamicCache):
    """The initialised layers of a transformers 5.x cache (keys/values [B, H, S, D])."""
    return [layer for layer in cache.layers if getattr(layer, "is_initialized", True) and layer.keys is not None]


def cache_width(cache: DynamicCache) -> int:
    layers = cache_layers(cache)
    return int(layers[0].keys.shape[-2]) if layers and layers[0].keys.dim() == 4 else 0


def _flat_index(rows: torch.Tensor | None, source: torch.Tensor, heads: int, slots: int) -> torch.Tensor:
    """Indices into keys.reshape(-1, D) selecting, for each kept row and head, the slots `source`."""
    batch = rows if rows is not None else torch.arange(source.shape[0], device=source.device)
    head = torch.arange(heads, device=source.device)
    return ((batch[:, None, None] * heads + head[None, :, None]) * slots + source[:, None, :]).reshape(-1)


def gather_cache(cache: DynamicCache, rows: torch.Tensor | None, source: torch.Tensor | None, width: int) -> None:
    """Keep `rows` (None: all) and, per row, the sequence slots `source[:, :width]` (None: the first
    `width` slots, a crop). One index_select per cache tensor over rows of head_dim elements
    (contiguous output, about the cost of a copy); a pure crop is a view (no copy)."""
    index_for: dict = {}  # the index depends only on (heads, slots): shared by all layers alike
    for layer in cache_layers(cache):
        if width == 0 or layer.keys.dim() != 4:  # nothing cached: an empty tensor fits any batch size
            layer.keys, layer.values = layer.keys.new_empty(0), layer.values.new_empty(0)
        elif source is None:
            keys, values = layer.keys[..., :width, :], layer.values[..., :width, :]
            if rows is not None:
                keys, values = keys[rows], values[rows]
            layer.keys, layer.values = keys, values
        else:
            _, heads, slots, dim = layer.keys.shape
            if (heads, slots) not in index_for:
                index_for[(heads, slots)] = _flat_index(rows, source[:, :width], heads, slots)
            index = index_for[(heads, slots)]
            shape = (source.shape[0], heads, width, dim)
            layer.keys = layer.keys.reshape(-1, dim).index_select(0, index).view(shape)
            layer.values = layer.values.reshape(-1, layer.values.shape[-1]).index_select(0, index).view(
                shape[:3] + (layer.values.shape[-1],))


def row_views(cache: DynamicCache, row: int, pad: int) -> list:
    """Views (no copy) of one row's K/V per layer, [T, H, D] from column `pad` on."""
    return [(layer.keys[row, :, pad:].transpose(0, 1), layer.values[row, :, pad:].transpose(0, 1))
            for layer in cache_layers(cache) if layer.keys.dim() == 4]


def stacked_cache(per_row_kv: list, keep: list[int]) -> DynamicCache:
    """Left-pad each row's first keep[i] entries and stack: one pad_sequence per cache tensor.

    (A row shorter than the batch's draft pending count keeps nothing: its first draft step re-feeds
    pad columns, which the masks hide.)"""
    cache = DynamicCache()
    template = next((kv for kv in per_row_kv if kv), None)  # a row whose draft cache is empty has no layers
    if template is None or max(keep) == 0:
        return cache
    for layer in range(len(template)):
        parts = []
        for part in (0, 1):
            pieces = [(kv[layer][part] if kv else template[layer][part])[:n if kv else 0]
                      for kv, n in zip(per_row_kv, keep)]
            parts.append(pad_sequence(pieces, batch_first=True, padding_side="left").transpose(1, 2))
        cache.update(parts[0], parts[1], layer)
    return cache
