"""End-to-end reference speculative decoding with real padding, masks and KV caches.

Slow and obvious on purpose. Rows live individually between rounds (tokens and unpadded K/V per
model); a rectangular round stacks them left-padded (the repad), runs draft and verify with
masks and positions derived from lengths, and unstacks them (the unpad). EQSPEC runs a fixed
batch this way; EXSPEC runs whatever the pool selects. The ragged round keeps every row in its
own slot row of a fixed buffer and writes K/V at the row's own offsets: nothing moves.

Every strategy must produce exactly `greedy_decode`'s tokens for every request (I5, I6).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..invariants import (TraceWriter, Violation, check_alignment, check_conservation, check_kv, check_mask, check_positions,
                          check_round_commit, mask_strings, raise_if)
from .pool import ExspecPool, FixedBatches, SlotQueue
from .rounds import commit_counts, committed_tokens, greedy_accept, proposal_lengths, ragged_commit, softmax_max
from .state import RaggedState, RectState, query_mask

from ..options import STRATEGIES, defaults  # the registry and defaults the torch engine, API and CLI share


@dataclass
class Options:
    k: int
    eos_ids: tuple
    pad_id: int = 0
    window: int | None = None  # sliding attention window, applied by position in the mask
    check: bool = False
    threshold: float = 0.0  # a row stops proposing when its draft confidence is below it (I7)
    floor: float | None = None  # ... proposing the step it stops at if its confidence is >= floor (None: never)
    caps: list | None = None  # the cap of each round in order (a fast engine's trace), default k


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


def check_row_kv(model, kv, tokens, pending: int, row: int, name: str):
    """I3 for one row: its cache holds exactly content[:len - pending], each entry equal to a fresh
    unpadded prefill (a rejected draft left behind is an extra entry)."""
    count, want = kv[0][0].shape[0], len(tokens) - pending
    if count != want:
        return [Violation("I3", f"{name} holds {count} entries, expected content 0..{want - 1}", row=row,
                          index=min(count, want), expected=want, actual=count)]
    fresh = model.kv_of(tokens)
    found = []
    for layer in range(model.n_layers):
        for part, label in ((0, "K"), (1, "V")):
            found += [replace(v, row=row) for v in check_kv(
                kv[layer][part][None], np.arange(count)[None], [count], lambda _: fresh[layer][part],
                rtol=1e-7, atol=1e-9, name=f"{name} layer {layer} {label}")]
    return found


def rect_round(rows, target, draft, opt: Options, round_index: int, trace_rows: list | None):
    """One round on a rectangular batch made of `rows` (repad), then unpad back into the rows.

    Returns per-row (committed tokens, accepted, k_round)."""
    state = RectState.from_rows([r.tokens for r in rows], opt.pad_id)
    (batch, width), pad, content = state.tokens.shape, state.pad_len, state.content_len
    remaining = np.array([r.remaining for r in rows])
    clamp = np.minimum(opt.k, remaining - 1) if draft is not None else np.zeros(batch, dtype=np.int64)
    limit = np.minimum(clamp, round_cap(opt, round_index))
    if opt.check:  # without I1 nothing below is meaningful: stop at once
        raise_if(check_alignment(pad, content, width), round_index)
    found = []
    drafted, confidence, proposed = np.zeros((batch, 0), dtype=np.int64), np.zeros((batch, 0)), np.zeros(batch, int)

    if limit.max() > 0:
        pending = max(r.draft_pending for r in rows)  # re-feed the last `pending` tokens of every row
        past = [stack_kv([r.draft_kv for r in rows], pad, width - pending, draft)]

        def step_fn(step, so_far):
            cols = np.arange(width - pending, width) if step == 0 else np.array([width + step - 1])
            toks = state.tokens[:, width - pending:] if step == 0 else so_far[:, -1:]
            logits, past[0], seen = forward_rect(draft, state, past[0], cols, toks, opt.window)
            if opt.check:
                found.extend(check_rect_forward(state, cols, seen, opt.window))
            return logits[:, -1]
        drafted, confidence, proposed = draft_rows(draft, limit, opt.threshold, step_fn, opt.floor)
        past_d = past[0]
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
                target_argmax=choice[i, :p + 1].tolist(), draft_limit=p, cap=round_cap(opt, round_index),
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
                found += check_row_kv(target, row.target_kv, row.tokens, 1, i, "target cache")
                if k_round:
                    found += check_row_kv(draft, row.draft_kv, row.tokens, row.draft_pending, i, "draft cache")
        raise_if(found, round_index)
    return accepted, k_round, proposed


def round_cap(opt: Options, round_index: int) -> int:
    """The round's cap on proposal lengths: the recorded cap of a fast engine's round, else k."""
    if opt.caps is not None and round_index - 1 < len(opt.caps) and opt.caps[round_index - 1] is not None:
        return int(opt.caps[round_index - 1])
    return opt.k


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
    clamp = np.minimum(opt.k, remaining - 1) if draft is not None else np.zeros(len(rows), dtype=np.int64)
    limit = np.minimum(clamp, round_cap(opt, round_index))
    found = []
    drafted, confidence, proposed = (np.zeros((len(rows), 0), dtype=np.int64), np.zeros((len(rows), 0)),
                                     np.zeros(len(rows), dtype=np.int64))
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
            return logits[:, -1]
        drafted, confidence, proposed = draft_rows(draft, limit, opt.threshold, step_fn, opt.floor)
    k_round = drafted.shape[1]  # draft steps run
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
        for i, row in enumerate(rows):
            p = int(proposed[i])
            trace_rows.append(dict(
                request=int(state.request[row]), prompt_len=int(state.prompt_len[row]),
                tokens=state.content(row), pad_len=0, content_len=int(content[i]),
                positions=seen["positions"][i][:p + 1].tolist(), mask=mask_strings(seen["allowed"][i][:p + 1]),
                drafted=drafted[i, :p].tolist(), target_argmax=choice[i, :p + 1].tolist(), draft_limit=p,
                cap=round_cap(opt, round_index), limit=int(limit[i]), draft_confidence=confidence[i].tolist(), accepted=int(accepted[i]),
                committed=committed[i], finished=bool(hit_eos[i] or n[i] == remaining[i])))
    ragged_commit(state, rows, committed)
    state.target_pending[rows] = 1
    if k_round:  # the draft ran on the pending tokens and d_1..d_{steps-1}
        state.draft_pending[rows] = n - np.minimum(np.minimum(accepted, k_round - 1), n)
    else:
        state.draft_pending[rows] += n

    if opt.check:
        for i, row in enumerate(rows):
            if hit_eos[i] or n[i] == remaining[i]:
                continue  # finished: its slot is released
            c = int(state.content_len[row])
            for model, name, pend in ((target, "target", 1), (draft, "draft", int(state.draft_pending[row]))):
                if model is not None and (name == "target" or k_round):
                    kv = [(k[row, : c - pend], v[row, : c - pend]) for k, v in caches[name]]
                    found += check_row_kv(model, kv, state.content(row), pend, i, f"{name} cache")
        raise_if(found, round_index)
    return accepted, n, hit_eos, k_round, proposed


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


def _new_rows(prompts, max_new, requests, target, draft, opt):
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


def generate(target, draft, prompts, *, max_new_tokens=None, k: int | None = None, eos_ids=(),
             strategy: str | None = None, batch_size: int | None = None, pad_id: int = 0, window: int | None = None,
             pool_window: int | None = None, max_wait: int | None = None, arrival=None, check: bool = False,
             trace=None, threshold: float = 0.0, floor: float | None = None, caps=None) -> ReferenceResult:
    """Reference batch speculative decoding; `draft=None` is target-only decoding.

    max_new_tokens, k (num_draft_tokens), strategy, batch_size, pool_window and max_wait default to
    specbatch.options.defaults(), the torch engine's defaults.
    max_new_tokens: int or one per prompt. arrival: the order requests are submitted (default:
    input order); results always come back in input order (S2). threshold: the proposal rule's
    confidence threshold (I7; 0: every row proposes its whole limit); floor: the step that stops a row
    proposes its token too when its confidence is >= floor (None: never); caps: each round's cap on
    proposal lengths (default k every round)."""
    d = defaults()
    max_new_tokens = d.max_new_tokens if max_new_tokens is None else max_new_tokens
    k = d.num_draft_tokens if k is None else k
    strategy = d.strategy if strategy is None else strategy
    batch_size = d.batch_size if batch_size is None else batch_size
    pool_window = d.pool_window if pool_window is None else pool_window
    max_wait = d.max_wait if max_wait is None else max_wait
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    opt = Options(k=k if draft is not None else 0, eos_ids=tuple(eos_ids), pad_id=pad_id, window=window, check=check,
                  threshold=threshold, floor=floor, caps=caps)
    count = len(prompts)
    max_new = [max_new_tokens] * count if np.isscalar(max_new_tokens) else list(max_new_tokens)
    order = list(range(count)) if arrival is None else list(arrival)
    results: dict = {}
    stats = dict(rounds=0, drafted_tokens=0, accepted_tokens=0, generated_tokens=0, grouped_rounds=0,
                 fallback_rounds=0, max_waited=0)
    writer = None
    if trace is not None:
        writer = TraceWriter(trace, layout="ragged" if strategy == "ragged" else "rectangular", strategy=strategy,
                             eos_token_ids=opt.eos_ids, max_new_tokens=max_new, num_requests=count,
                             window=window, num_draft_tokens=opt.k, draft_threshold=threshold,
                             draft_floor=threshold if floor is None else floor)

    def account(accepted, n, proposed, trace_rows):
        stats["rounds"] += 1
        stats["drafted_tokens"] += int(np.sum(proposed))
        stats["accepted_tokens"] += int(np.sum(accepted))
        stats["generated_tokens"] += int(np.sum(n))
        if writer is not None:
            writer.round(stats["rounds"], trace_rows)

    if strategy == "eqspec":
        batches = FixedBatches(batch_size)
        for r in order:
            batches.submit(r)
        live: dict = {}
        while batches.queue or batches.running:
            admitted = batches.next_batch()
            for row in _new_rows(prompts, max_new, admitted, target, draft, opt):
                live[row.request] = row
            rows = [live[r] for r in batches.running]
            stats["grouped_rounds" if len({r.key for r in rows}) == 1 else "fallback_rounds"] += 1
            trace_rows = [] if writer is not None else None
            lens = np.array([len(r.tokens) for r in rows])
            accepted, k_round, proposed = rect_round(rows, target, draft, opt, stats["rounds"] + 1, trace_rows)
            account(accepted, np.array([len(r.tokens) for r in rows]) - lens, proposed, trace_rows)
            finished = [r.request for r in rows if r.stop_reason is not None]
            for r in finished:
                results[r] = live.pop(r)
            batches.finish(finished)
            if check:
                raise_if(check_conservation(range(count), batches.members()), stats["rounds"])
    elif strategy == "exspec":
        pool = ExspecPool(batch_size, window=pool_window or 4 * batch_size, max_wait=max_wait)
        for r in order:
            pool.submit(r)
        live = {}
        while pool.queue or pool.pool:
            admitted = pool.admit()
            for row in _new_rows(prompts, max_new, admitted, target, draft, opt):
                live[row.request] = row
                pool.enter(row.request, row.key)
            chosen, grouped = pool.select()
            stats["grouped_rounds" if grouped else "fallback_rounds"] += 1
            stats["max_waited"] = max([stats["max_waited"]] + [r.waited for r in pool.pool])
            rows = [live[r] for r in chosen]
            trace_rows = [] if writer is not None else None
            lens = np.array([len(r.tokens) for r in rows])
            accepted, k_round, proposed = rect_round(rows, target, draft, opt, stats["rounds"] + 1, trace_rows)
            account(accepted, np.array([len(r.tokens) for r in rows]) - lens, proposed, trace_rows)
            finished = {r.request for r in rows if r.stop_reason is not None}
            for r in finished:
                results[r] = live.pop(r)
            pool.finish_round({r.request: r.key for r in rows}, finished)
            if check:
                raise_if(check_conservation(range(count), pool.members()), stats["rounds"])
    else:
        capacity = max(len(p) for p in prompts) + max(max_new) + opt.k + 1
        state = RaggedState.empty(batch_size, capacity)
        caches = {name: [(np.zeros((batch_size, capacity, m.dim)), np.zeros((batch_size, capacity, m.dim)))
                         for _ in range(m.n_layers)]
                  for name, m in (("target", target), ("draft", draft)) if m is not None}
        slots = SlotQueue(batch_size)
        for r in order:
            slots.submit(r)
        while slots.queue or any(o >= 0 for o in slots.owner):
            placed = slots.refill()
            if placed:
                new_rows = _new_rows(prompts, max_new, [r for _, r in placed], target, draft, opt)
                for (slot, r), row in zip(placed, new_rows):
                    state.tokens[slot, :len(row.tokens)] = row.tokens
                    state.content_len[slot], state.request[slot] = len(row.tokens), r
                    state.target_pending[slot] = state.draft_pending[slot] = 1
                    state.prompt_len[slot], state.budget_end[slot] = len(row.tokens), len(row.tokens) + max_new[r]
                    for name, kv in (("target", row.target_kv), ("draft", row.draft_kv)):
                        for layer, (k_, v_) in enumerate(kv):
                            caches[name][layer][0][slot, :len(k_)] = k_
                            caches[name][layer][1][slot, :len(v_)] = v_
            for src, dst in slots.compact():  # running rows stay in slots 0..R-1
                move_slot(state, caches, src, dst)
            rows = np.nonzero(state.active)[0]
            trace_rows = [] if writer is not None else None
            accepted, n, hit_eos, k_round, proposed = ragged_round(state, caches, rows, target, draft, opt,
                                                                   stats["rounds"] + 1, trace_rows)
            account(accepted, n, proposed, trace_rows)
            for i, slot in enumerate(rows):
                if hit_eos[i] or state.content_len[slot] == state.budget_end[slot]:
                    r = int(state.request[slot])
                    results[r] = Row(r, state.content(slot), int(state.prompt_len[slot]), 0,
                                     stop_reason="eos" if hit_eos[i] else "length")
                    slots.release(slot)
                    state.request[slot] = -1
            if check:
                raise_if(check_conservation(range(count), slots.members()), stats["rounds"])

    sequences = [results[r].tokens[results[r].prompt_len:] for r in range(count)]
    stop_reasons = [results[r].stop_reason for r in range(count)]
    if writer is not None:
        writer.results(sequences, stop_reasons)
    return ReferenceResult(sequences, stop_reasons, stats)
