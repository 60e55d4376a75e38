"""A transformers `Cache` for the ragged layout: one preallocated buffer row per slot, written at
per-row offsets, never moved.

Before each forward the engine says how many slot rows take part (rows 0..R-1: the engine keeps its
running rows there), where each query's K/V goes (`write_index` [R, Q]: the query's content index;
negative for a pad query, which writes into a spare trash slot) and how many slots the queries may
look at (`kv_len`). Each layer's `update` scatters the new K/V into the buffer and returns a view of
the first `kv_len` slots of those rows;
the 4D mask the engine passes hides everything but content 0..q of the row (I4), so stale slots
(rejected drafts, earlier requests) need no clearing (proofs_notes/ragged.md).

The buffers come from `SPARES`, the process's K/V buffers kept between generations: a fresh buffer
of hundreds of MB pays the kernel's page faults on first touch, a kept one a memset (SmolLM2's
float32 slot cache for 13 Spec-Bench prompts is 540 MB; a generation of 128 tokens at batch 13 on
an Intel Xeon took 7.61-7.70 s with kept buffers against 7.69-7.84 s with fresh ones). A cache
gives its buffers back when its generation ends (`release`).

A packed prefill (fast.compute.prefill) is the other kind of forward: one sequence holding the prompts of
several rows back to back. `prepare_packed` gives each query its own slot row and content index;
`update` scatters the K/V there and returns the pack's own K/V, which is all a fresh prompt can
see (the block-diagonal mask keeps prompts apart).
"""
from __future__ import annotations

import math
import threading

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SparePool:
    """K/V buffers kept between generations (CPU only: on an accelerator torch's caching allocator
    already reuses freed memory). `take` hands out a zeroed buffer, a kept one where one is large
    enough (the smallest such), so that slots no forward wrote hold zeros: a masked score's
    probability is exactly 0, and 0 times a finite value is 0. `give` takes buffers back; the
    spares never exceed the most bytes the caches held at once (`peak`), so no more memory is kept
    than a generation used. Thread-safe."""

    def __init__(self):
        self.spare: list[torch.Tensor] = []  # flat buffers no cache holds
        self.in_use = 0  # bytes of the buffers handed out and not given back
        self.peak = 0
        self.lock = threading.Lock()

    def take(self, shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(a zeroed tensor of `shape`, the flat buffer it views: what `give` takes back)."""
        numel = math.prod(shape)
        flat = None
        if torch.device(device).type == "cpu":
            with self.lock:
                fits = [i for i, b in enumerate(self.spare) if b.dtype == dtype and b.numel() >= numel]
                if fits:
                    flat = self.spare.pop(min(fits, key=lambda i: self.spare[i].numel()))
        if flat is None:
            flat = torch.zeros(numel, dtype=dtype, device=device)
        else:
            with torch.inference_mode():  # a buffer made inside a forward's inference mode
                flat[:numel].zero_()
        with self.lock:
            self.in_use += _bytes(flat)
            self.peak = max(self.peak, self.in_use)
        return flat[:numel].view(shape), flat

    def give(self, buffers: list) -> None:
        """Keep `buffers` (taken from this pool, no longer read) for later caches; the smallest
        spares are dropped while the spares hold more than `peak` bytes."""
        with self.lock:
            self.in_use -= sum(_bytes(b) for b in buffers)
            self.spare += [b for b in buffers if b.device.type == "cpu"]
            self.spare.sort(key=_bytes, reverse=True)
            kept = sum(_bytes(b) for b in self.spare)
            while kept > self.peak:
                kept -= _bytes(self.spare.pop())

    def clear(self) -> int:
        """Drop every spare buffer; returns the bytes freed."""
        with self.lock:
            freed = sum(_bytes(b) for b in self.spare)
            self.spare = []
            return freed


def _bytes(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.element_size()


SPARES = SparePool()


def release_buffers() -> int:
    """Free the K/V buffers kept for later generations (`specbatch.release_buffers`); returns the
    bytes freed."""
    return SPARES.clear()


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
        dtype = self.owner.storage_dtype or key_states.dtype
        self.keys, key_buffer = SPARES.take((slots, heads, capacity, key_states.shape[-1]), dtype, key_states.device)
        self.values, value_buffer = SPARES.take((slots, heads, capacity, value_states.shape[-1]), dtype,
                                                value_states.device)
        self.owner.buffers += [key_buffer, value_buffer]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner
        flat = owner.flat_index(self.keys.shape[1], self.keys.shape[2])
        self.keys.view(-1, self.keys.shape[-1]).index_copy_(
            0, flat, key_states.reshape(-1, key_states.shape[-1]).to(self.keys.dtype))
        self.values.view(-1, self.values.shape[-1]).index_copy_(
            0, flat, value_states.reshape(-1, value_states.shape[-1]).to(self.values.dtype))
        if owner.packed:  # a fresh pack of prompts sees only itself
            return key_states, value_states
        return self.keys[:owner.rows, :, :owner.kv_len], self.values[:owner.rows, :, :owner.kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv_len, 0

    def get_seq_length(self) -> int:
        return self.owner.kv_len

    def get_max_length(self) -> int:
        return self.owner.capacity


class SlotCache(Cache):
    """`slots` buffer rows of `capacity` positions for every layer of one model."""

    def __init__(self, num_layers: int, slots: int, capacity: int, device, storage_dtype=None):
        """storage_dtype: keep K/V in this dtype (None: the model's). A bfloat16 model on a CPU keeps
        them in float32 (exact widening), where attention's small products run much faster."""
        self.slots, self.capacity, self.device, self.storage_dtype = slots, capacity, device, storage_dtype
        self.rows, self.packed, self._flat_index = slots, False, None
        self.buffers: list[torch.Tensor] = []  # what the layers took from SPARES
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])

    def release(self) -> None:
        """Give the layers' buffers back to SPARES: the cache's generation is over (a later forward
        would take fresh ones)."""
        for layer in self.layers:
            layer.keys = layer.values = None
            layer.is_initialized = False
        buffers, self.buffers = self.buffers, []
        SPARES.give(buffers)

    def flat_index(self, heads: int, capacity: int) -> torch.Tensor:
        """Rows of a layer's keys.view(-1, D) for each (query row, head, query) of the forward's
        key_states [R, H, Q, D]: computed once per forward, shared by the layers of equal shape."""
        if self._flat_index is None or self._flat_index[0] != (heads, capacity):
            head = torch.arange(heads, device=self.write_slot.device)
            flat = (self.row_of_query[:, None, :] * heads + head[None, :, None]) * capacity + self.write_slot[:, None, :]
            self._flat_index = ((heads, capacity), flat.reshape(-1))
        return self._flat_index[1]

    def _write_slots(self, query_index: torch.Tensor) -> torch.Tensor:
        self._flat_index = None  # a new forward: its queries write elsewhere
        return torch.where(query_index >= 0, query_index, torch.full_like(query_index, self.capacity))

    def prepare(self, count: int, query_index: torch.Tensor, kv_len: int) -> None:
        """Set up the next forward over slot rows 0..count-1 (the engine keeps its running rows there):
        each query's content index, and the number of slots to attend over (largest query index + 1,
        known on the host). The layers then return views of the buffers: nothing is copied."""
        self.rows, self.packed = count, False
        self.row_of_query = torch.arange(count, device=self.device)[:, None].expand(query_index.shape)
        self.write_slot = self._write_slots(query_index)
        self.kv_len = kv_len

    def prepare_flat(self, token_row: torch.Tensor, token_index: torch.Tensor, count: int, kv_len: int) -> None:
        """Set up a flat forward over slot rows 0..count-1: query t of the single sequence belongs to
        row token_row[t] at content index token_index[t]. The layers return views of the rows' first
        kv_len slots; fast.compute.attention.flat_attention pairs each query with its own row."""
        self.rows, self.packed = count, False
        self.row_of_query = token_row[None]
        self.write_slot = self._write_slots(token_index[None])
        self.kv_len = kv_len

    def prepare_packed(self, slot_of_query: torch.Tensor, query_index: torch.Tensor) -> None:
        """Set up a packed prefill: query j of the single pack row writes slot row slot_of_query[0, j]
        at content index query_index[0, j] (negative: the trash slot)."""
        self.rows, self.packed = None, True
        self.row_of_query = slot_of_query
        self.write_slot = self._write_slots(query_index)
        self.kv_len = query_index.shape[1]

    def move_row(self, src: int, dst: int, count: int) -> None:
        """Copy the first `count` slots of buffer row src into row dst, in every layer (compaction)."""
        for layer in self.layers:
            if layer.is_initialized:
                with torch.inference_mode():  # the buffers were made inside the forward's inference mode
                    layer.keys[dst, :, :count] = layer.keys[src, :, :count]
                    layer.values[dst, :, :count] = layer.values[src, :, :count]

    def keep_path(self, rows: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> None:
        """After a tree verify: row rows[m]'s slots source[m, j] are copied to target[m, j], in every
        layer (the accepted path's scratch slots to its content slots; entries past a row's path
        name the trash slot in both). Every source is read before anything is written."""
        for layer in self.layers:
            if layer.is_initialized:
                with torch.inference_mode():
                    for buffer in (layer.keys, layer.values):
                        moved = buffer[rows[:, None], :, source]  # [M, L, H, D]
                        buffer[rows[:, None], :, target] = moved

    def slot_values(self, layer: int, row: int, count: int):
        """Keys and values [count, H, D] held by slots 0..count-1 of one row (for checking I3)."""
        lay = self.layers[layer]
        return lay.keys[row, :, :count].transpose(0, 1), lay.values[row, :, :count].transpose(0, 1)
