"""The reference's rounds, with real padding, masks and KV caches (reference.strategies runs them).

Slow and obvious on purpose. Rows live individually between rounds (tokens and unpadded K/V per
model); a rectangular round (`rect_round`) stacks them left-padded (the repad), runs draft and
verify with masks and positions derived from lengths, and unstacks them (the unpad). EQSPEC runs
a fixed batch this way; EXSPEC runs whatever the pool selects. The ragged round (`ragged_round`)
keeps every row in its own slot row of a fixed buffer and writes K/V at the row's own offsets:
nothing moves.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..invariants import (Violation, check_alignment, check_kv, check_mask, check_positions, check_round_commit,
                          mask_strings, raise_if)
from .rounds import commit_counts, committed_tokens, greedy_accept, proposal_lengths, ragged_commit, softmax_max
from .state import RaggedState, RectState, query_mask


@dataclass
class Options:
    k: int
    eos_ids: tuple
    pad_id: int = 0
    window: int | None = None  # sliding attention window, applied by position in the mask
    check: bool = False
    threshold: float = 0.0  # a row stops proposing when its draft confidence is below it (I7)
    floor: float | None = None  # ... proposing the step it stops at if its confidence is >= floor (None: never)
    branches: int = 1  # ragged: candidates verified per drafted position (reference.trees.sibling_tree; 1: chains)


def draft_rows(draft, limit, threshold, step_fn, floor=None):
    """Draft step by step (step_fn(step) -> the draft's last-query logits [B, V], fed by the caller
    with the previous proposals) and apply the proposal rule: returns (drafted [B, steps run],
    confidence [B, steps run], proposed [B]). Drafting stops once no row goes on (every row has
    reached its limit or a step below the threshold)."""
    batch = len(limit)
    drafted, confidence = np.zeros((batch, 0), dtype=np.int64), np.zeros((batch, 0))
    active = np.asarray(limit) > 0
    for step in range(int(np.max(limit, initial=0))):
        logits = step_fn(step, drafted)
        conf = draft.confidence_of(logits) if hasattr(draft, "confidence_of") else softmax_max(logits)
        drafted = np.concatenate([drafted, logits.argmax(-1)[:, None]], axis=1)
        confidence = np.concatenate([confidence, np.asarray(conf, dtype=float)[:, None]], axis=1)
        active &= (step < np.asarray(limit)) & (confidence[:, -1] >= threshold)
        if not active.any():
            break
    return drafted, confidence, proposal_lengths(confidence, limit, threshold, floor)


@dataclass
class Row:
    """One request between rounds: its tokens and the K/V each model holds for it (unpadded)."""

    request: int
    tokens: list
    prompt_len: int
    max_new: int
    target_kv: list = field(default_factory=list)  # per layer (K, V) [T, D]: content[:len - 1]
    draft_kv: list = field(default_factory=list)  # per layer (K, V): content[:len - draft_pending]
    draft_pending: int = 1
    waited: int = 0
    stop_reason: str | None = None

    @property
    def remaining(self) -> int:
        return self.prompt_len + self.max_new - len(self.tokens)

    @property
    def key(self) -> tuple:
        return (len(self.tokens), 1, self.draft_pending)


@dataclass
class ReferenceResult:
    sequences: list
    stop_reasons: list
    stats: dict


def forward_rect(model, state: RectState, past, cols, tokens, window):
    """Forward the given columns of a rectangular batch whose cache covers columns [0, cols[0]).

    Positions and the mask come from the layout's lengths (I2, I4). Returns logits, the extended
    cache, and what the forward saw (for checks and traces)."""
    slot_index = state.slot_index(int(cols[-1]) + 1)
    query_index = slot_index[:, cols]
    allowed = query_mask(query_index, slot_index, window)
    positions = state.position_ids(cols)
    logits, new_kv = model.forward(tokens, positions, past, allowed)
    past = [(np.concatenate([k0, k1], 1), np.concatenate([v0, v1], 1)) for (k0, v0), (k1, v1) in zip(past, new_kv)]
    return logits, past, dict(positions=positions, allowed=allowed)


def check_rect_forward(state: RectState, cols, seen, window):
    """I2 and I4 for one rectangular forward, with the expected indices derived from lengths."""
    pad = state.width - state.content_len
    slot_index = np.arange(int(cols[-1]) + 1)[None, :] - pad[:, None]
    query_index = slot_index[:, cols]
    return check_positions(seen["positions"], query_index) + check_mask(seen["allowed"], query_index, slot_index, window)


def stack_kv(kvs, pad_len, width, model):
    """Left-pad each row's K/V into `width` columns: row i's first width - pad_len[i] entries."""
    batch = len(kvs)
    past = []
    for layer in range(model.n_layers):
        keys, values = np.zeros((batch, width, model.dim)), np.zeros((batch, width, model.dim))
        for i, kv in enumerate(kvs):
            count = width - pad_len[i]
            if count > 0:
                keys[i, pad_len[i]:] = kv[layer][0][:count]
                values[i, pad_len[i]:] = kv[layer][1][:count]
        past.append((keys, values))
    return past


def unstack_kv(past, row, start, count):
    return [(k[row, start:start + count].copy(), v[row, start:start + count].copy()) for k, v in past]


def prefill(model, prefixes, pad_id, window):
    """Batched, left-padded prefill of each row's prefix; returns each row's unpadded K/V."""
    state = RectState.from_rows(prefixes, pad_id)
    if state.width == 0:
        return [[(np.zeros((0, model.dim)), np.zeros((0, model.dim)))] * model.n_layers for _ in prefixes]
    cols = np.arange(state.width)
    _, past, _ = forward_rect(model, state, model.empty_past(len(prefixes)), cols, state.tokens, window)
    return [unstack_kv(past, i, state.pad_len[i], len(p)) for i, p in enumerate(prefixes)]


def check_row_kv(model, kv, tokens, pending: int, row: int, name: str, window: int | None = None):
    """I3 for one row: its cache holds exactly content[:len - pending], each entry equal to a fresh
    unpadded prefill (a rejected draft left behind is an extra entry)."""
    count, want = kv[0][0].shape[0], len(tokens) - pending
    if count != want:
        return [Violation("I3", f"{name} holds {count} entries, expected content 0..{want - 1}", row=row,
                          index=min(count, want), expected=want, actual=count)]
    fresh = model.kv_of(tokens, window)
    found = []
    for layer in range(model.n_layers):
        for part, label in ((0, "K"), (1, "V")):
            found += [replace(v, row=row) for v in check_kv(
                kv[layer][part][None], np.arange(count)[None], [count], lambda _: fresh[layer][part],
                rtol=1e-7, atol=1e-9, name=f"{name} layer {layer} {label}")]
    return found


def draft_rect(rows, state: RectState, draft, limit, opt: Options, found: list):
    """The draft's proposals on a rectangular batch: (drafted [B, steps], confidence [B, steps],
    proposed [B], the draft's extended cache or None when no row may draft); I2/I4 of each draft
    forward go to `found` under opt.check."""
    batch, width = state.tokens.shape
    if limit.max() <= 0:
        return np.zeros((batch, 0), dtype=np.int64), np.zeros((batch, 0)), np.zeros(batch, int), None
    pending = max(r.draft_pending for r in rows)  # re-feed the last `pending` tokens of every row
    past = [stack_kv([r.draft_kv for r in rows], state.pad_len, width - pending, draft)]

    def step_fn(step, so_far):
        cols = np.arange(width - pending, width) if step == 0 else np.array([width + step - 1])
        toks = state.tokens[:, width - pending:] if step == 0 else so_far[:, -1:]
        logits, past[0], seen = forward_rect(draft, state, past[0], cols, toks, opt.window)
        if opt.check:
            found.extend(check_rect_forward(state, cols, seen, opt.window))
        return logits[:, -1]
    drafted, confidence, proposed = draft_rows(draft, limit, opt.threshold, step_fn, opt.floor)
    return drafted, confidence, proposed, past[0]


def rect_round(rows, target, draft, opt: Options, round_index: int, trace_rows: list | None):
    """One round on a rectangular batch made of `rows` (repad), then unpad back into the rows.

    Returns per-row (committed tokens, accepted, k_round)."""
    state = RectState.from_rows([r.tokens for r in rows], opt.pad_id)
    (batch, width), pad, content = state.tokens.shape, state.pad_len, state.content_len
    remaining = np.array([r.remaining for r in rows])
    limit = np.minimum(opt.k, remaining - 1) if draft is not None else np.zeros(batch, dtype=np.int64)
    if opt.check:  # without I1 nothing below is meaningful: stop at once
        raise_if(check_alignment(pad, content, width), round_index)
    found = []
    drafted, confidence, proposed, past_d = draft_rect(rows, state, draft, limit, opt, found)
    k_round = drafted.shape[1]  # draft steps run
    width_q = int(proposed.max(initial=0))  # the longest proposal: shorter rows never accept the rest

    past_t = stack_kv([r.target_kv for r in rows], pad, width - 1, target)
    cols = np.arange(width - 1, width + width_q)
    toks = np.concatenate([state.tokens[:, -1:], drafted[:, :width_q]], axis=1)
    logits, past_t, seen = forward_rect(target, state, past_t, cols, toks, opt.window)
    choice = logits.argmax(-1)
    accepted = greedy_accept(drafted[:, :width_q], choice, proposed)
    n, hit_eos = commit_counts(choice, accepted, remaining, opt.eos_ids)
    committed = committed_tokens(choice, drafted, n)
    if opt.check:
        found += check_rect_forward(state, cols, seen, opt.window)
        found += check_round_commit(drafted[:, :width_q], choice, proposed, accepted, committed, remaining,
                                    opt.eos_ids)

    for i, row in enumerate(rows):
        if trace_rows is not None:
            p = int(proposed[i])
            trace_rows.append(dict(
                request=row.request, prompt_len=row.prompt_len, tokens=state.tokens[i].tolist(), pad_len=int(pad[i]),
                content_len=int(content[i]), positions=seen["positions"][i][:p + 1].tolist(),
                mask=mask_strings(seen["allowed"][i][:p + 1]), drafted=drafted[i, :p].tolist(),
                target_argmax=choice[i, :p + 1].tolist(), draft_limit=p, cap=opt.k,
                limit=int(limit[i]),
                draft_confidence=confidence[i].tolist(), accepted=int(accepted[i]), committed=committed[i],
                finished=bool(hit_eos[i] or n[i] == remaining[i])))
        row.tokens = row.tokens + list(committed[i])
        row.target_kv = unstack_kv(past_t, i, pad[i], content[i] + n[i] - 1)
        if k_round:
            valid = content[i] + min(accepted[i], k_round - 1, n[i])  # d_k never went through the draft
            row.draft_kv = unstack_kv(past_d, i, pad[i], valid)
            row.draft_pending = len(row.tokens) - valid
        else:
            row.draft_pending += int(n[i])
        if hit_eos[i] or n[i] == remaining[i]:
            row.stop_reason = "eos" if hit_eos[i] else "length"
    if opt.check:
        for i, row in enumerate(rows):
            if row.stop_reason is None:
                found += check_row_kv(target, row.target_kv, row.tokens, 1, i, "target cache", opt.window)
                if k_round:
                    found += check_row_kv(draft, row.draft_kv, row.tokens, row.draft_pending, i, "draft cache",
                                          opt.window)
        raise_if(found, round_index)
    return accepted, k_round, proposed


def forward_slots(model, cache, rows, q_index, tokens, window):
    """Ragged forward: each row writes its new K/V at its own slots q_index, then attends.

    cache: per layer (K, V) [slots, capacity, D]. A slot is visible to query q iff it holds a
    content index <= q: cached slots below the row's first query, and this forward's own slots.
    Negative q_index entries are pad queries: they write nothing and are never read."""
    capacity = cache[0][0].shape[1]
    first = np.maximum(q_index[:, :1], 0)
    past_index = np.where(np.arange(capacity)[None, :] < first, np.arange(capacity)[None, :], -1)
    slot_index = np.concatenate([past_index, q_index], axis=1)
    allowed = query_mask(q_index, slot_index, window)
    positions = np.maximum(q_index, 0)
    past = [(k[rows], v[rows]) for k, v in cache]
    logits, new_kv = model.forward(tokens, positions, past, allowed)
    r, q = np.nonzero(q_index >= 0)
    for (keys, values), (k_new, v_new) in zip(cache, new_kv):
        keys[rows[r], q_index[r, q]] = k_new[r, q]
        values[rows[r], q_index[r, q]] = v_new[r, q]
    # what the queries saw, in slot coordinates (slot s holds content s)
    width = int(q_index.max()) + 1
    seen_slots = np.zeros((len(rows), q_index.shape[1], width), dtype=bool)
    for col in range(slot_index.shape[1]):
        s = slot_index[:, col]
        ok = (s >= 0) & (s < width)
        seen_slots[np.nonzero(ok)[0], :, s[ok]] |= allowed[ok, :, col]
    return logits, dict(positions=positions, allowed=seen_slots, query_index=q_index,
                        slot_index=np.broadcast_to(np.arange(width), (len(rows), width)))


def ragged_round(state: RaggedState, caches, rows, target, draft, opt: Options, round_index, trace_rows):
    """One round over the active slot rows `rows`; commits in place at each row's own offset."""
    content = state.content_len[rows].copy()
    remaining = state.budget_end[rows] - content
    limit = np.minimum(opt.k, remaining - 1) if draft is not None else np.zeros(len(rows), dtype=np.int64)
    found = []
    drafted, confidence, proposed = (np.zeros((len(rows), 0), dtype=np.int64), np.zeros((len(rows), 0)),
                                     np.zeros(len(rows), dtype=np.int64))
    step_logits = []  # [B, V] per draft step: the sibling leaves of a tree round
    if limit.max() > 0:
        pending = int(state.draft_pending[rows].max())

        def step_fn(step, so_far):
            if step == 0:
                q_index = content[:, None] - pending + np.arange(pending)[None, :]
                toks = np.where(q_index >= 0, state.tokens[rows[:, None], np.maximum(q_index, 0)], opt.pad_id)
            else:
                q_index, toks = content[:, None] + step - 1, so_far[:, -1:]
            logits, seen = forward_slots(draft, caches["draft"], rows, q_index, toks, opt.window)
            if opt.check:
                found.extend(check_positions(seen["positions"], seen["query_index"]))
                found.extend(check_mask(seen["allowed"], seen["query_index"], seen["slot_index"], opt.window))
            step_logits.append(logits[:, -1])
            return logits[:, -1]
        drafted, confidence, proposed = draft_rows(draft, limit, opt.threshold, step_fn, opt.floor)
    k_round = drafted.shape[1]  # draft steps run
    if opt.branches > 1 and k_round:
        from .trees import ragged_tree_round  # reference.trees builds on this module
        return ragged_tree_round(state, caches, rows, target, draft, opt, drafted, proposed, step_logits, found,
                                 round_index)
    width_q = int(proposed.max(initial=0))

    # each row verifies its own proposals only: query j > p_i is a pad query (writes and sees nothing)
    j = np.arange(width_q + 1)[None, :]
    q_index = np.where(j <= proposed[:, None], content[:, None] - 1 + j, -1)
    toks = np.concatenate([state.tokens[rows, content - 1][:, None], drafted[:, :width_q]], axis=1)
    logits, seen = forward_slots(target, caches["target"], rows, q_index, toks, opt.window)
    choice = logits.argmax(-1)
    accepted = greedy_accept(drafted[:, :width_q], choice, proposed)
    n, hit_eos = commit_counts(choice, accepted, remaining, opt.eos_ids)
    committed = committed_tokens(choice, drafted, n)
    if opt.check:
        found += check_positions(seen["positions"], seen["query_index"])
        found += check_mask(seen["allowed"], seen["query_index"], seen["slot_index"], opt.window)
        found += check_round_commit(drafted[:, :width_q], choice, proposed, accepted, committed, remaining,
                                    opt.eos_ids)
    if trace_rows is not None:
        trace_rows += [_ragged_trace_row(state, row, i, content, seen, drafted, proposed, choice, opt.k, limit,
                                         confidence, accepted, committed, hit_eos[i] or n[i] == remaining[i])
                       for i, row in enumerate(rows)]
    ragged_commit(state, rows, committed)
    state.target_pending[rows] = 1
    if k_round:  # the draft ran on the pending tokens and d_1..d_{steps-1}
        state.draft_pending[rows] = n - np.minimum(np.minimum(accepted, k_round - 1), n)
    else:
        state.draft_pending[rows] += n

    if opt.check:
        live = [(i, row) for i, row in enumerate(rows) if not (hit_eos[i] or n[i] == remaining[i])]
        found += _check_slot_caches(state, caches, live, target, draft if k_round else None, opt.window)
        raise_if(found, round_index)
    return accepted, n, hit_eos, k_round, proposed


def _ragged_trace_row(state: RaggedState, row: int, i: int, content, seen, drafted, proposed, choice, k: int, limit,
                      confidence, accepted, committed, finished) -> dict:
    """Row i's trace row (invariants.trace) of a ragged round."""
    p = int(proposed[i])
    return dict(request=int(state.request[row]), prompt_len=int(state.prompt_len[row]), tokens=state.content(row),
                pad_len=0, content_len=int(content[i]), **_verified_row(seen, i, p), drafted=drafted[i, :p].tolist(),
                target_argmax=choice[i, :p + 1].tolist(), draft_limit=p, cap=k, limit=int(limit[i]),
                draft_confidence=confidence[i].tolist(), accepted=int(accepted[i]), committed=committed[i],
                finished=bool(finished))


def _verified_row(seen, i, p):
    """Row i's verify queries in a trace: positions and mask of its own p + 1 queries."""
    return dict(positions=seen["positions"][i][:p + 1].tolist(), mask=mask_strings(seen["allowed"][i][:p + 1]))


def _check_slot_caches(state: RaggedState, caches, live, target, draft, window: int | None = None):
    """I3 after a round for each live (i, row): the target's K/V covers content minus its one pending
    token, the draft's (when it ran) content minus its own pending count (fresh prefills under the
    sliding window, if any)."""
    found = []
    for i, row in live:
        c = int(state.content_len[row])
        for model, name, pend in ((target, "target", 1), (draft, "draft", int(state.draft_pending[row]))):
            if model is not None:
                kv = [(k[row, : c - pend], v[row, : c - pend]) for k, v in caches[name]]
                found += check_row_kv(model, kv, state.content(row), pend, i, f"{name} cache", window)
    return found


def move_slot(state: RaggedState, caches, src: int, dst: int) -> None:
    """Move one running request from slot src to the free slot dst: its tokens, lengths and the K/V
    of both caches (SlotQueue.compact decides the moves)."""
    for name in ("tokens", "content_len", "request", "prompt_len", "budget_end", "target_pending", "draft_pending"):
        array = getattr(state, name)
        array[dst] = array[src]
    state.request[src] = -1
    for layers in caches.values():
        for keys, values in layers:
            keys[dst], values[dst] = keys[src], values[src]


def new_rows(prompts, max_new, requests, target, draft, opt) -> list[Row]:
    """Rows for newly admitted requests, each prefilled alone (content[:-1] into both caches)."""
    if not requests:
        return []
    rows = [Row(r, list(prompts[r]), len(prompts[r]), max_new[r]) for r in requests]
    prefixes = [row.tokens[:-1] for row in rows]
    for row, kv in zip(rows, prefill(target, prefixes, opt.pad_id, opt.window)):
        row.target_kv = kv
    if draft is not None:
        for row, kv in zip(rows, prefill(draft, prefixes, opt.pad_id, opt.window)):
            row.draft_kv = kv
    return rows
