"""Attention over the engine's caches, computed per group of rows of similar length.

Rows of one batch attend over very different numbers of slots (a 60-token question next to a
770-token document). A single attention call over the longest row makes every row read that many
key/value slots; on a CPU the read is the cost. Before each forward the engine may give each row's
visible length (`kv_lens`); rows are then grouped by length and each group reads only up to its
own longest row, where the slots saved cost more than the calls added (the price of a call in
slots is measured on the machine: fast.compute.attention_cost). The engine's 4D mask still
decides alone what a query sees (I4): a group's mask is the engine's mask restricted to the
group's rows and first slots, and every slot past a row's visible length is hidden in that mask
anyway, so grouping changes which hidden slots are skipped, nothing else.

Each part is computed by plain attention: scores = q k^T * scale + mask, softmax (in float32 for
half-precision inputs), times v, with grouped-query heads handled by a view instead of a copy; or
by SDPA's kernel, where it measured faster for the few-query shapes of decoding and verifying
(`Plan.sdpa`: it differs between CPUs, fast.compute.attention_cost). Many-query forwards (prefill)
go to SDPA.

On an accelerator (fast.compute.backend: `grouped_attention` off) every forward is one group over all rows,
read up to the longest visible length, and every product is one fused SDPA call (`Plan.fused`):
a kernel launch per group costs more there than the slots grouping saves.

What the forward about to run needs beyond its tensors (its `Plan`) is set in a context variable
by `forward_plan` and read by every layer (`current_plan()`): it is scoped to the `with` block and
to the thread, so a forward started inside another one (or on another thread) cannot see or
clobber the outer forward's plan.

`engine_attention(models)` switches every Hugging Face model inside the given modules to this
implementation for the duration of a generation and restores the previous one afterwards.
Models whose code does not use transformers' AttentionInterface keep their own attention.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

NAME = "specbatch"
SDPA_MIN_QUERIES = 16  # from this many queries per row on, SDPA's kernel wins (prefill)
GROUP_COST = 256  # one more part's cost in row-slots where none was measured (engine_attention measures it)


def plan_groups(kv_lens: np.ndarray, max_groups: int = 4, candidates: int = 32,
                group_cost: float = GROUP_COST) -> list[tuple[np.ndarray, int]]:
    """Rows (indices into the batch) grouped by visible length, each with its group's length.

    Over splits of the rows sorted by length, minimises the slots read (rows x the group's longest
    length, summed over groups) plus group_cost per extra group (dynamic programming over at most
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
    count = min(range(1, max_groups + 1), key=lambda g: best[g][m] + group_cost * (g - 1))
    out, i = [], m
    for g in range(count, 0, -1):
        j = cut[g][i]
        out.append((np.sort(order[bounds[j]:bounds[i]]), int(lens[bounds[i] - 1])))
        i = j
    return out[::-1]


def plan_parts(groups: list[tuple[np.ndarray, int]], group_cost: float = GROUP_COST) -> list[tuple[object, int]]:
    """How each group is read: as slices of consecutive rows (views, nothing copied) where its rows
    form few runs, else gathered into one copy. Returns (slice or row index array, length) parts.

    Gathering copies the group's slots and reads them again (about 2 x rows x length row-slots
    more); each extra slice costs one more call (group_cost row-slots)."""
    parts = []
    for rows, length in groups:
        runs = np.split(rows, np.nonzero(np.diff(rows) != 1)[0] + 1)
        if (len(runs) - 1) * group_cost <= 2 * len(rows) * length:
            parts += [(slice(int(run[0]), int(run[-1]) + 1), length) for run in runs]
        else:
            parts.append((rows, length))
    return parts


class FlatPart:
    """Rows of a flat forward (fast.strategies.ragged's verify: every row's query tokens laid end to
    end in one sequence, no padding) that attend together: their key rows, the number of slots they
    read, and where their queries sit in the flat sequence.

    tokens [n, Qmax]: flat index of query j of each row (short rows repeat their last query);
    query_index [n, Qmax]: its content index (-1 on the repeats); mask [n, 1, Qmax, length]: the
    additive mask (query j of a row sees slots 0..query_index, I4; repeats see nothing);
    cells / targets: the valid (row, j) cells of tokens.view(-1) and the flat positions they fill;
    run: those positions as a slice where they are one run in order (every row of the part has
    Qmax queries, rows in order): the part then reads and writes views, nothing gathered."""

    def __init__(self, rows, length, tokens, query_index, mask, cells, targets, run=None):
        self.rows, self.length, self.tokens, self.query_index = rows, length, tokens, query_index
        self.mask, self.cells, self.targets, self.run = mask, cells, targets, run


def flat_plan(token_row: np.ndarray, token_index: np.ndarray, window: int | None, dtype, fill: float,
              device, position=None, ancestors=None) -> list[FlatPart]:
    """The parts of a flat forward whose query t belongs to row token_row[t] (rows 0..R-1, each row's
    queries consecutive and in order) at content index token_index[t].

    A tree verify (fast.layout.TreeLayout) also gives each query its position [N] and the nodes of
    its row it sees, ancestors [N, W]: token_index is then the query's scratch slot, and the mask is
    tree_visibility's."""
    token_row, token_index = np.asarray(token_row), np.asarray(token_index)
    rows = int(token_row.max()) + 1
    start = np.searchsorted(token_row, np.arange(rows))
    count = np.bincount(token_row, minlength=rows)
    visible = np.zeros(rows, dtype=np.int64)
    np.maximum.at(visible, token_row, token_index + 1)
    parts = []
    plan = current_plan()
    for members, length in plan_parts(plan_groups(visible, plan.max_groups, group_cost=plan.group_cost),
                                      plan.group_cost):
        index = np.arange(rows)[members]
        width = int(count[index].max())
        j = np.arange(width)[None, :]
        real = j < count[index][:, None]
        tokens = start[index][:, None] + np.minimum(j, count[index][:, None] - 1)
        query = np.where(real, token_index[tokens], -1)
        slot = np.arange(length)[None, None, :]
        if ancestors is None:
            seen = (slot <= query[:, :, None]) & real[:, :, None]
            if window is not None:
                seen &= slot > query[:, :, None] - window
        else:
            seen = tree_visibility(start[index], tokens, real, position, ancestors, length, window)
        mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(torch.as_tensor(~seen), fill)[:, None]
        cells = np.nonzero(real.reshape(-1))[0]
        flat_tokens = tokens.reshape(-1)
        first = int(flat_tokens[0])
        in_order = real.all() and np.array_equal(flat_tokens, np.arange(first, first + len(flat_tokens)))
        parts.append(FlatPart(members if isinstance(members, slice) else torch.as_tensor(members, device=device),
                              int(length), torch.as_tensor(flat_tokens, device=device), query,
                              mask.to(device), torch.as_tensor(cells, device=device),
                              torch.as_tensor(flat_tokens[cells], device=device),
                              slice(first, first + len(flat_tokens)) if in_order else None))
    return parts


def tree_visibility(root: np.ndarray, tokens: np.ndarray, real: np.ndarray, position: np.ndarray,
                    ancestors: np.ndarray, length: int, window: int | None) -> np.ndarray:
    """[n, Qmax, length] bool: what each tree query sees (I4 for trees). root [n]: flat index of each
    row's root, whose slot is c - 1; node b of the row sits in slot c - 1 + b. A query sees slots
    0..c - 2 and the slots of its ancestors and itself; within a window, only those whose position
    (a slot's own number below the root, the node's position from the root on) is within it."""
    root_slot = position[root]  # the root sits at depth 0: its position is its slot, c - 1
    slot = np.arange(length)[None, None, :]
    node = slot - root_slot[:, None, None]  # [n, 1, length]: node number of a tree slot
    width = ancestors.shape[1]
    in_tree = (node >= 0) & (node < width)
    node_c = np.clip(node, 0, width - 1)
    seen_tree = np.take_along_axis(ancestors[tokens], np.broadcast_to(node_c, tokens.shape + (length,)), axis=2)
    seen = (slot < root_slot[:, None, None]) | (in_tree & seen_tree)
    if window is not None:
        node_position = position[np.minimum(root[:, None] + node_c[:, 0, :], len(position) - 1)]  # [n, length]
        slot_position = np.where(in_tree[:, 0, :], node_position, slot[:, 0, :])
        seen &= slot_position[:, None, :] > position[tokens][:, :, None] - window
    return seen & real[:, :, None]


@dataclass(frozen=True)
class Plan:
    """What the forward about to run needs beyond its tensors (set by ModelRunner, read by every
    layer): `parts`, row groups by visible length (each a slice of rows or a row index tensor, with
    the number of slots its rows read), or `flat`, the FlatParts of a flat forward."""

    parts: list | None = None
    flat: list | None = None
    fused: bool = False  # one group of rows and SDPA's fused kernels (engine_attention(fused=True))
    group_cost: float = GROUP_COST  # one more part's cost in row-slots (fast.compute.attention_cost)
    sdpa: bool = False  # parts computed by SDPA's kernel, measured faster here (fast.compute.attention_cost)
    segments: tuple | None = None  # a packed prefill's prompts (start, end): its mask is causal within each

    @property
    def max_groups(self) -> int:
        return 1 if self.fused else 4


_PLAN: ContextVar[Plan] = ContextVar("specbatch_attention_plan", default=Plan())


def current_plan() -> Plan:
    """The plan of the forward running in this context (forward_plan, engine_attention)."""
    return _PLAN.get()


@contextmanager
def scoped_plan(plan: Plan):
    """`plan` in force for the block, the previous one restored after it (also on an error)."""
    token = _PLAN.set(plan)
    try:
        yield plan
    finally:
        _PLAN.reset(token)


def forward_plan(kv_lens=None, device=None, flat=None, segments=None):
    """Group the rows of the next forward by their visible lengths (host array, or None), or give
    the parts of a flat forward, or a packed prefill's prompt segments: a scoped_plan for the block."""
    outer = current_plan()
    parts = None
    if kv_lens is not None:
        groups = plan_groups(np.asarray(kv_lens), outer.max_groups, group_cost=outer.group_cost)
        parts = [(rows if isinstance(rows, slice) else torch.as_tensor(rows, device=device), length)
                 for rows, length in plan_parts(groups, outer.group_cost)]
    return scoped_plan(Plan(parts, flat, outer.fused, outer.group_cost, outer.sdpa, segments))


def plain_attention(query, key, value, mask, scaling, softcap=None):
    """softmax(q k^T * scaling + mask) v for q [B, H, Q, D], k/v [B, Hkv, S, D], mask [B, 1, Q, S].

    Keys and values may be stored in a wider dtype than the queries (a float32 cache for a bfloat16
    model): the product is then computed in the cache's dtype and returned in the query's. Under
    a fused plan, or where the plan found it faster (Plan.sdpa), SDPA's kernel computes the same
    (without softcap)."""
    out_dtype = query.dtype
    plan = current_plan()
    if (plan.fused or plan.sdpa) and softcap is None:
        out = F.scaled_dot_product_attention(query.to(key.dtype), key, value, scale=scaling,
                                             attn_mask=None if mask is None else mask.to(key.dtype),
                                             enable_gqa=query.shape[1] != key.shape[1])
        return out.to(out_dtype)
    if key.dtype != query.dtype:
        query = query.to(key.dtype)
    batch, heads, queries, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    group = heads // kv_heads
    # head h reads kv head h // group: each kv head's group of query heads is one operand of one
    # batched product (bmm over views of the cache: its rows and heads merge without a copy)
    q = query.reshape(batch * kv_heads, group * queries, dim)
    scores = torch.bmm(q, key.reshape(batch * kv_heads, slots, dim).transpose(1, 2))  # [B Hkv, G Q, S]
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    scores = scores.mul_(scaling)  # a fresh tensor: in place
    if softcap is not None:  # Gemma 2 style: scores squashed to (-softcap, softcap) before the mask
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores.view(batch, kv_heads, group, queries, slots).add_(mask[:, :, None])
    probs = scores.softmax(dim=-1)
    if probs.dtype != value.dtype:
        probs = probs.to(value.dtype)
    out = torch.bmm(probs, value.reshape(batch * kv_heads, slots, value.shape[-1]))
    out = out.view(batch, heads, queries, value.shape[-1])
    return out if out.dtype == out_dtype else out.to(out_dtype)


def rows_of(tensor, rows, length):
    """tensor[rows, :, :length] for a slice (a view) or a row index tensor (a copy)."""
    if isinstance(rows, slice):
        return tensor[rows, :, :length]
    return tensor[:, :, :length].index_select(0, rows)


def grouped_attention(query, key, value, mask, scaling, softcap=None):
    """plain_attention per part of the rows, each reading only its own first `length` slots."""
    parts = current_plan().parts or [(slice(0, query.shape[0]), key.shape[2])]
    if len(parts) == 1 and isinstance(parts[0][0], slice):
        length = parts[0][1]
        return plain_attention(query, key[:, :, :length], value[:, :, :length],
                               None if mask is None else mask[..., :length], scaling, softcap)
    out = query.new_empty(query.shape[:3] + (value.shape[-1],))
    for rows, length in parts:
        part = plain_attention(rows_of(query, rows, None), rows_of(key, rows, length), rows_of(value, rows, length),
                               None if mask is None else rows_of(mask, rows, None)[..., :length], scaling, softcap)
        if isinstance(rows, slice):
            out[rows] = part
        else:
            out.index_copy_(0, rows, part)
    return out


def flat_attention(query, key, value, scaling, softcap=None):
    """Attention of a flat forward: query [1, H, T, D] holds every row's queries end to end, key and
    value [R, Hkv, S, D] are the rows' caches; each FlatPart gathers its rows' queries into
    [n, H, Qmax, D], attends over its rows' first `length` slots with its own mask, and puts the
    results back at the queries' flat positions. Returns [1, T, H, D], the layout the layer's output
    projection reads (a decode step's single part with one query a row: a view, nothing copied)."""
    heads, dim = query.shape[1], value.shape[-1]
    tokens = query.shape[2]
    flat_q = query[0]  # [H, T, D]
    parts = current_plan().flat
    out = None
    for part in parts:
        n, width = part.mask.shape[0], part.mask.shape[2]
        picked = flat_q[:, part.run] if part.run is not None else flat_q.index_select(1, part.tokens)
        q = picked.view(heads, n, width, query.shape[-1]).transpose(0, 1)
        o = plain_attention(q, rows_of(key, part.rows, part.length), rows_of(value, part.rows, part.length),
                            part.mask, scaling, softcap)  # [n, H, Qmax, D]
        o = o.transpose(1, 2).reshape(n * width, heads, dim)  # [n Qmax, H, D]: a view where Qmax is 1
        if len(parts) == 1 and part.run is not None:  # every query, in order: o is the output
            return o[None]
        if out is None:
            out = o.new_empty(1, tokens, heads, dim)
        if part.run is not None:
            out[0, part.run] = o
        else:
            out[0].index_copy_(0, part.targets, o.index_select(0, part.cells))
    return out


def segment_attention(query, key, value, segments, scaling):
    """Attention of a packed prefill (fast.compute.prefill) whose mask is block-diagonal causal: each
    prompt's queries [start, end) attend causally over its own keys only, as the mask says (I4),
    computed per prompt so that no score across prompts, or above the diagonal, is computed at all.
    query [1, H, T, D], key and value [1, Hkv, T, D] (the pack's own)."""
    out = query.new_empty(query.shape[:3] + (value.shape[-1],))
    for start, end in segments:
        part = F.scaled_dot_product_attention(query[:, :, start:end].to(key.dtype), key[:, :, start:end],
                                              value[:, :, start:end], is_causal=True, scale=scaling,
                                              enable_gqa=query.shape[1] != key.shape[1])
        out[:, :, start:end] = part.to(out.dtype)
    return out


def specbatch_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                        **kwargs):
    """An AttentionInterface function: returns (output [B, Q, H, D], None)."""
    softcap, plan = kwargs.get("softcap"), current_plan()
    unsupported = kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None or dropout \
        or key.shape[1] == 0 or query.shape[1] % key.shape[1]
    if unsupported:
        if plan.flat is not None:
            raise RuntimeError(f"{type(module).__name__} needs attention features the flat forward does not have")
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    dtype = query.dtype
    if key.dtype != dtype:  # a wider cache (float32 K/V of a bfloat16 model): widen the queries once, not per part
        query = query.to(key.dtype)
    if plan.flat is not None:  # [1, T, H, D] already
        return flat_attention(query, key, value, scaling, softcap).to(dtype), None
    if plan.segments is not None and query.shape[2] >= SDPA_MIN_QUERIES and softcap is None:
        out = segment_attention(query, key, value, plan.segments, scaling)
    elif query.shape[2] >= SDPA_MIN_QUERIES and dtype in (torch.float32, torch.float64) and softcap is None:
        length = max(length for _, length in plan.parts) if plan.parts else key.shape[2]
        mask = None if attention_mask is None else attention_mask[..., :length]
        out = F.scaled_dot_product_attention(query, key[:, :, :length], value[:, :, :length], attn_mask=mask,
                                             scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    else:
        out = grouped_attention(query, key, value, attention_mask, scaling, softcap)
    return out.to(dtype).transpose(1, 2).contiguous(), None


def uses_engine_attention(module) -> bool:
    """Whether every Hugging Face model inside `module` runs specbatch_attention right now (inside
    engine_attention, for a model whose code uses AttentionInterface)."""
    from transformers import PreTrainedModel
    models = [m for m in module.modules() if isinstance(m, PreTrainedModel)]
    return bool(models) and all(m.config._attn_implementation == NAME for m in models)


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


def _measured_pricing(modules) -> tuple[bool, float]:
    """(SDPA's kernel or plain, one more part's cost in row-slots) for the first model's attention
    shapes (the target's: it reads the most), measured on its device (fast.compute.attention_cost);
    K/V as the CPU engine keeps them (float32 for a half-precision model,
    fast.compute.slot_forward.storage_dtype)."""
    from .attention_cost import pricing_of
    for root in modules:
        parameter = next(root.parameters(), None) if root is not None else None
        if parameter is None or not hasattr(root, "config"):
            continue
        device, dtype = parameter.device, parameter.dtype
        if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
            dtype = torch.float32
        measured = pricing_of(root.config, device, dtype)
        return (False, GROUP_COST) if measured is None else measured
    return False, GROUP_COST


@contextmanager
def engine_attention(*modules, fused: bool = False):
    """Use specbatch_attention in every model inside `modules` for the duration of the block; fused:
    one group of rows and SDPA's kernels (fast.compute.backend); else rows split into parts at the
    price of a part, and each part computed by the kernel, measured on this machine."""
    register()
    configs = _configs(modules)
    before = [c._attn_implementation for c in configs]
    try:
        for c in configs:
            c._attn_implementation = NAME
        sdpa, cost = (False, GROUP_COST) if fused or not configs else _measured_pricing(modules)
        with scoped_plan(Plan(fused=fused, group_cost=cost, sdpa=sdpa)):
            yield
    finally:
        for c, value in zip(configs, before):
            c._attn_implementation = value
