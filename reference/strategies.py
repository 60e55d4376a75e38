"""The reference's strategies: one function per strategy, each the NumPy twin of a class in
fast.strategies, named in `STRATEGIES` under the same name (a test keeps the two name sets equal).

A strategy is called as strategy(job): it submits `job.order`, runs rounds (engine.rect_round or
engine.ragged_round) until every request is done, and puts each finished row in `job.results`.
Its `layout` attribute ("rectangular" or "ragged", set by `@layout`) is the round trace's layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..invariants import check_conservation, raise_if
from . import engine
from .engine import Options, Row, move_slot, new_rows
from .pool import ExspecPool, FixedBatches, SlotQueue
from .state import RaggedState


def layout(name: str):
    """Mark a strategy function with its trace layout."""
    def mark(strategy):
        strategy.layout = name
        return strategy
    return mark


@dataclass
class Job:
    """One generate call as its strategy sees it: the models, the requests and the round settings,
    and what comes back (finished rows in `results`, counters in `stats`, rounds in `writer`)."""

    target: object
    draft: object  # None: target-only decoding
    prompts: list
    max_new: list  # [N] budget per request
    order: list  # the order requests are submitted in
    opt: Options
    batch_size: int
    pool_window: int | None = None  # exspec: rows it looks at (None: 4 x batch_size)
    max_wait: int = 4  # exspec: rounds a row may wait before it is taken first
    writer: object = None  # invariants.TraceWriter or None
    results: dict = field(default_factory=dict)
    stats: dict = field(default_factory=lambda: dict(rounds=0, drafted_tokens=0, accepted_tokens=0, generated_tokens=0,
                                                      grouped_rounds=0, fallback_rounds=0, max_waited=0))

    def new_rows(self, requests) -> list[Row]:
        return new_rows(self.prompts, self.max_new, requests, self.target, self.draft, self.opt)

    def trace_rows(self) -> list | None:
        return [] if self.writer is not None else None

    def account(self, accepted, n, proposed, trace_rows) -> None:
        """Count one round: proposals, acceptances and committed tokens; trace it."""
        self.stats["rounds"] += 1
        self.stats["drafted_tokens"] += int(np.sum(proposed))
        self.stats["accepted_tokens"] += int(np.sum(accepted))
        self.stats["generated_tokens"] += int(np.sum(n))
        if self.writer is not None:
            self.writer.round(self.stats["rounds"], trace_rows)

    def check_members(self, members) -> None:
        """S1 after a round (with check_invariants): every request in exactly one place."""
        if self.opt.check:
            raise_if(check_conservation(range(len(self.prompts)), members), self.stats["rounds"])

    def rect_round(self, rows: list[Row]) -> None:
        """One rectangular round (engine.rect_round) over `rows`, counted."""
        trace_rows, lens = self.trace_rows(), np.array([len(r.tokens) for r in rows])
        accepted, _, proposed = engine.rect_round(rows, self.target, self.draft, self.opt, self.stats["rounds"] + 1,
                                           trace_rows)
        self.account(accepted, np.array([len(r.tokens) for r in rows]) - lens, proposed, trace_rows)


@layout("rectangular")
def eqspec(job: Job) -> None:
    """Fixed batches in submission order; a finished row leaves its batch at once."""
    batches, live = FixedBatches(job.batch_size), {}
    for r in job.order:
        batches.submit(r)
    while batches.queue or batches.running:
        live.update({row.request: row for row in job.new_rows(batches.next_batch())})
        rows = [live[r] for r in batches.running]
        job.stats["grouped_rounds" if len({r.key for r in rows}) == 1 else "fallback_rounds"] += 1
        job.rect_round(rows)
        finished = [r.request for r in rows if r.stop_reason is not None]
        job.results.update({r: live.pop(r) for r in finished})
        batches.finish(finished)
        job.check_members(batches.members())


@layout("rectangular")
def exspec(job: Job) -> None:
    """A pool between rounds; each round the largest group of equal keys (ExspecPool.select)."""
    pool, live = ExspecPool(job.batch_size, window=job.pool_window or 4 * job.batch_size, max_wait=job.max_wait), {}
    for r in job.order:
        pool.submit(r)
    while pool.queue or pool.pool:
        for row in job.new_rows(pool.admit()):
            live[row.request] = row
            pool.enter(row.request, row.key)
        chosen, grouped = pool.select()
        job.stats["grouped_rounds" if grouped else "fallback_rounds"] += 1
        job.stats["max_waited"] = max([job.stats["max_waited"]] + [r.waited for r in pool.pool])
        rows = [live[r] for r in chosen]
        job.rect_round(rows)
        finished = {r.request for r in rows if r.stop_reason is not None}
        job.results.update({r: live.pop(r) for r in finished})
        pool.finish_round({r.request: r.key for r in rows}, finished)
        job.check_members(pool.members())


@layout("ragged")
def ragged(job: Job) -> None:
    """Slot rows with per-row offsets in one buffer per model; a freed slot is refilled at once."""
    capacity = max(len(p) for p in job.prompts) + max(job.max_new) + job.opt.k + 1
    state, slots = RaggedState.empty(job.batch_size, capacity), SlotQueue(job.batch_size)
    caches = {name: [(np.zeros((job.batch_size, capacity, m.dim)), np.zeros((job.batch_size, capacity, m.dim)))
                     for _ in range(m.n_layers)]
              for name, m in (("target", job.target), ("draft", job.draft)) if m is not None}
    for r in job.order:
        slots.submit(r)
    while slots.queue or any(o >= 0 for o in slots.owner):
        placed = slots.refill()
        for (slot, _), row in zip(placed, job.new_rows([r for _, r in placed])):
            _place(state, caches, slot, row)
        for src, dst in slots.compact():  # running rows stay in slots 0..R-1
            move_slot(state, caches, src, dst)
        rows, trace_rows = np.nonzero(state.active)[0], job.trace_rows()
        accepted, n, hit_eos, _, proposed = engine.ragged_round(state, caches, rows, job.target, job.draft, job.opt,
                                                         job.stats["rounds"] + 1, trace_rows)
        job.account(accepted, n, proposed, trace_rows)
        for i, slot in enumerate(rows):
            if hit_eos[i] or state.content_len[slot] == state.budget_end[slot]:
                r = int(state.request[slot])
                job.results[r] = Row(r, state.content(slot), int(state.prompt_len[slot]), 0,
                                     stop_reason="eos" if hit_eos[i] else "length")
                slots.release(slot)
                state.request[slot] = -1
        job.check_members(slots.members())


def _place(state: RaggedState, caches, slot: int, row: Row) -> None:
    """Put a new (prefilled) row into a free slot: its tokens, lengths and both models' K/V."""
    state.tokens[slot, :len(row.tokens)] = row.tokens
    state.content_len[slot], state.request[slot] = len(row.tokens), row.request
    state.target_pending[slot] = state.draft_pending[slot] = 1
    state.prompt_len[slot], state.budget_end[slot] = len(row.tokens), len(row.tokens) + row.max_new
    for name, kv in (("target", row.target_kv), ("draft", row.draft_kv)):
        for layer, (keys, values) in enumerate(kv):
            caches[name][layer][0][slot, :len(keys)] = keys
            caches[name][layer][1][slot, :len(values)] = values


STRATEGIES = {"eqspec": eqspec, "exspec": exspec, "ragged": ragged}


def register(name: str, strategy) -> None:
    """Add the reference twin of a strategy registered in fast.strategies under the same name
    (a function of a Job, marked with its @layout)."""
    if name in STRATEGIES:
        raise ValueError(f"a reference strategy named {name!r} is already registered")
    STRATEGIES[name] = strategy
