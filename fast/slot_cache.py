"""A transformers `Cache` for the ragged layout: one preallocated buffer row per slot, written at
per-row offsets, never moved.

Before each forward the engine says which slot rows take part (`rows`, None for all), where each
query's K/V goes (`write_index` [R, Q]: the query's content index; negative for a pad query, which
writes into a spare trash slot) and how many slots the queries may look at (`kv_len`). Each layer's
`update` scatters the new K/V into the buffer and returns the first `kv_len` slots of those rows;
the 4D mask the engine passes hides everything but content 0..q of the row (I4), so stale slots
(rejected drafts, earlier requests) need no clearing (proofs_notes/ragged.md).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlotLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "SlotCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        slots, capacity = self.owner.slots, self.owner.capacity + 1  # + the trash slot
        heads = key_states.shape[1]
        self.keys = key_states.new_zeros(slots, heads, capacity, key_states.shape[-1])
        self.values = value_states.new_zeros(slots, heads, capacity, value_states.shape[-1])
        self.is_initialized = True

    def _flat_index(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        heads, capacity = self.keys.shape[1], self.keys.shape[2]
        head = torch.arange(heads, device=index.device)
        return ((rows[:, None, None] * heads + head[None, :, None]) * capacity + index[:, None, :]).reshape(-1)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner
        flat = self._flat_index(owner.row_index, owner.write_slot)
        self.keys.view(-1, self.keys.shape[-1]).index_copy_(0, flat, key_states.reshape(-1, key_states.shape[-1]))
        self.values.view(-1, self.values.shape[-1]).index_copy_(
            0, flat, value_states.reshape(-1, value_states.shape[-1]))
        keys, values = self.keys[:, :, :owner.kv_len], self.values[:, :, :owner.kv_len]
        if owner.rows is not None:  # a subset of slots (new rows' prefill, or a batch with idle slots)
            keys, values = keys.index_select(0, owner.rows), values.index_select(0, owner.rows)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv_len, 0

    def get_seq_length(self) -> int:
        return self.owner.kv_len

    def get_max_length(self) -> int:
        return self.owner.capacity


class SlotCache(Cache):
    """`slots` buffer rows of `capacity` positions for every layer of one model."""

    def __init__(self, num_layers: int, slots: int, capacity: int, device):
        self.slots, self.capacity, self.device = slots, capacity, device
        self.rows = None
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])

    def prepare(self, rows: torch.Tensor | None, query_index: torch.Tensor, kv_len: int) -> None:
        """Set up the next forward: rows (None: all slots, in order), each query's content index, and
        the number of slots to attend over (largest query index + 1, known on the host)."""
        self.rows = rows
        self.row_index = rows if rows is not None else torch.arange(self.slots, device=self.device)
        self.write_slot = torch.where(query_index >= 0, query_index, torch.full_like(query_index, self.capacity))
        self.kv_len = kv_len

    def slot_values(self, layer: int, row: int, count: int):
        """Keys and values [count, H, D] held by slots 0..count-1 of one row (for checking I3)."""
        lay = self.layers[layer]
        return lay.keys[row, :, :count].transpose(0, 1), lay.values[row, :, :count].transpose(0, 1)
