"""Attention over the engine's caches, computed per group of rows of similar length.

Rows of one batch attend over very different numbers of slots (a 60-token question next to a
770-token document). A single attention call over the longest row makes every row read that many
key/value slots; on a CPU the read is the cost. Before each forward the engine may give each row's
visible length (`kv_lens`); rows are then grouped by length and each group reads only up to its
own longest row. The engine's 4D mask still decides alone what a query sees (I4): a group's mask
is the engine's mask restricted to the group's rows and first slots, and every slot past a row's
visible length is hidden in that mask anyway, so grouping changes which hidden slots are skipped,
nothing else.

The computation itself is plain attention: scores = q k^T * scale + mask, softmax (in float32 for
half-precision inputs), times v, with grouped-query heads handled by a view instead of a copy.
On this CPU it is faster than SDPA's kernel for the few-query shapes of decoding and verifying
(and much faster in bfloat16); many-query forwards (prefill) go to SDPA.

`engine_attention(models)` switches every Hugging Face model inside the given modules to this
implementation for the duration of a generation and restores the previous one afterwards.
Models whose code does not use transformers' AttentionInterface keep their own attention.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

NAME = "specbatch"
SDPA_MIN_QUERIES = 16  # from this many queries per row on, SDPA's kernel wins (prefill)
GROUP_COST = 256  # one more group costs about as much as reading this many extra slots per row


def plan_groups(kv_lens: np.ndarray, max_groups: int = 4, candidates: int = 32) -> list[tuple[np.ndarray, int]]:
    """Rows (indices into the batch) grouped by visible length, each with its group's length.

    Over splits of the rows sorted by length, minimises the slots read (rows x the group's longest
    length, summed over groups) plus GROUP_COST per extra group (dynamic programming over at most
    `candidates` places to split: between distinct lengths, thinned out evenly by rank)."""
    kv_lens = np.asarray(kv_lens)
    order = np.argsort(kv_lens, kind="stable")
    lens = kv_lens[order]
    n = len(lens)
    if n <= 1 or lens[0] == lens[-1]:
        return [(np.arange(n), int(lens[-1]) if n else 0)]
    ends = np.nonzero(np.diff(lens))[0] + 1  # a split may fall only where the length changes
    if len(ends) > candidates:
        ends = ends[np.linspace(0, len(ends) - 1, candidates).round().astype(int)]
    bounds = [0] + [int(e) for e in ends] + [n]  # candidate group edges in the sorted order
    m = len(bounds) - 1
    inf = float("inf")
    best = [[inf] * (m + 1) for _ in range(max_groups + 1)]  # best[g][i]: rows before bounds[i] in g groups
    cut = [[0] * (m + 1) for _ in range(max_groups + 1)]
    best[0][0] = 0
    for g in range(1, max_groups + 1):
        for i in range(1, m + 1):
            longest = int(lens[bounds[i] - 1])
            for j in range(i):  # the last group: sorted rows bounds[j]..bounds[i]-1
                cost = best[g - 1][j] + (bounds[i] - bounds[j]) * longest
                if cost < best[g][i]:
                    best[g][i], cut[g][i] = cost, j
    count = min(range(1, max_groups + 1), key=lambda g: best[g][m] + GROUP_COST * (g - 1))
    out, i = [], m
    for g in range(count, 0, -1):
        j = cut[g][i]
        out.append((np.sort(order[bounds[j]:bounds[i]]), int(lens[bounds[i] - 1])))
        i = j
    return out[::-1]


def plan_parts(groups: list[tuple[np.ndarray, int]]) -> list[tuple[object, int]]:
    """How each group is read: as slices of consecutive rows (views, nothing copied) where its rows
    form few runs, else gathered into one copy. Returns (slice or row index array, length) parts.

    Gathering copies the group's slots and reads them again (about 2 x rows x length row-slots
    more); each extra slice costs one more call (GROUP_COST)."""
    parts = []
    for rows, length in groups:
        runs = np.split(rows, np.nonzero(np.diff(rows) != 1)[0] + 1)
        if (len(runs) - 1) * GROUP_COST <= 2 * len(rows) * length:
            parts += [(slice(int(run[0]), int(run[-1]) + 1), length) for run in runs]
        else:
            parts.append((rows, length))
    return parts


class Plan:
    """The parts of the forward about to run (set by ModelRunner, read by every layer): each a
    slice of rows or a row index tensor, with the number of slots its rows read."""

    parts: list | None = None


PLAN = Plan()


@contextmanager
def forward_plan(kv_lens, device):
    """Group the rows of the next forward by their visible lengths (host array, or None)."""
    if kv_lens is None:
        PLAN.parts = None
    else:
        PLAN.parts = [(rows if isinstance(rows, slice) else torch.as_tensor(rows, device=device), length)
                      for rows, length in plan_parts(plan_groups(np.asarray(kv_lens)))]
    try:
        yield
    finally:
        PLAN.parts = None


def plain_attention(query, key, value, mask, scaling):
    """softmax(q k^T * scaling + mask) v for q [B, H, Q, D], k/v [B, Hkv, S, D], mask [B, 1, Q, S].

    Keys and values may be stored in a wider dtype than the queries (a float32 cache for a bfloat16
    model): the product is then computed in the cache's dtype and returned in the query's."""
    out_dtype = query.dtype
    if key.dtype != query.dtype:
        query = query.to(key.dtype)
    batch, heads, queries, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    group = heads // kv_heads
    q = query.reshape(batch, kv_heads, group * queries, dim)  # head h reads kv head h // group
    scores = torch.matmul(q, key.transpose(-1, -2)).view(batch, kv_heads, group, queries, slots)
    low = scores.dtype in (torch.float16, torch.bfloat16)
    scores = scores.float() if low else scores
    scores = scores * scaling
    if mask is not None:
        scores = scores + mask[:, :, None].to(scores.dtype)
    probs = scores.softmax(dim=-1).to(value.dtype).view(batch, kv_heads, group * queries, slots)
    return torch.matmul(probs, value).view(batch, heads, queries, value.shape[-1]).to(out_dtype)


def grouped_attention(query, key, value, mask, scaling):
    """plain_attention per part of the rows, each reading only its own first `length` slots."""
    parts = PLAN.parts or [(slice(0, query.shape[0]), key.shape[2])]
    if len(parts) == 1 and isinstance(parts[0][0], slice):
        length = parts[0][1]
        return plain_attention(query, key[:, :, :length], value[:, :, :length],
                               None if mask is None else mask[..., :length], scaling)
    out = query.new_empty(query.shape[:3] + (value.shape[-1],))
    for rows, length in parts:
        if isinstance(rows, slice):  # consecutive rows: views, nothing copied
            out[rows] = plain_attention(query[rows], key[rows, :, :length], value[rows, :, :length],
                                        None if mask is None else mask[rows, ..., :length], scaling)
        else:
            out.index_copy_(0, rows, plain_attention(
                query.index_select(0, rows), key[:, :, :length].index_select(0, rows),
                value[:, :, :length].index_select(0, rows),
                None if mask is None else mask[..., :length].index_select(0, rows), scaling))
    return out


def specbatch_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                        **kwargs):
    """An AttentionInterface function: returns (output [B, Q, H, D], None)."""
    unsupported = kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None \
        or kwargs.get("position_bias") is not None or dropout
    if unsupported or key.shape[1] == 0 or query.shape[1] % key.shape[1]:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if query.shape[2] >= SDPA_MIN_QUERIES and query.dtype in (torch.float32, torch.float64):
        length = max(length for _, length in PLAN.parts) if PLAN.parts else key.shape[2]
        mask = None if attention_mask is None else attention_mask[..., :length]
        out = F.scaled_dot_product_attention(query, key[:, :, :length], value[:, :, :length], attn_mask=mask,
                                             scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    else:
        out = grouped_attention(query, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def uses_engine_attention(module) -> bool:
    """Whether every Hugging Face model inside `module` routes its attention through
    AttentionInterface (and so through specbatch_attention under engine_attention)."""
    from transformers import PreTrainedModel
    models = [m for m in module.modules() if isinstance(m, PreTrainedModel)]
    return bool(models) and all(m._can_set_attn_implementation() for m in models)


def register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, specbatch_attention)


def _configs(modules):
    """The distinct configs of the Hugging Face models inside `modules` that use AttentionInterface."""
    from transformers import PreTrainedModel
    seen = {}
    for root in modules:
        if root is None:
            continue
        for m in root.modules():
            if isinstance(m, PreTrainedModel) and m._can_set_attn_implementation():
                seen[id(m.config)] = m.config
    return list(seen.values())


@contextmanager
def engine_attention(*modules):
    """Use specbatch_attention in every model inside `modules` for the duration of the block."""
    register()
    configs = _configs(modules)
    before = [c._attn_implementation for c in configs]
    try:
        for c in configs:
            c._attn_implementation = NAME
        yield
    finally:
        for c, value in zip(configs, before):
            c._attn_implementation = value
