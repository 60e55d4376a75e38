"""EXSPEC: a sequence pool between rounds; each round batches rows of equal length (and equal
pending state) so that nothing needs realigning, and falls back to a realigned batch otherwise.

Scheduling is reference.pool.ExspecPool (shared with the reference): a window of W rows, the
largest same-key group if it fills at least half the batch, else the oldest rows; a row that
waited `max_wait` rounds is taken first, which bounds waiting (S3). New requests are prefilled
on their own and enter the pool; a running batch is never re-prefilled. When a round selects
the same rows as the last one, the batch is kept as it is (its EQSPEC update already aligned it);
otherwise its rows go back to the pool as views and the new batch is stacked, which is where
EXSPEC pays: stacking a group is one concatenation per cache tensor, a fallback also pads.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from ...invariants import check_conservation
from ...reference.pool import ExspecPool
from ..compute.cache import row_views, stacked_cache
from ..engine import Arrivals, Settings, Stats
from ..rect_proposer import rect_proposer_class
from .eqspec import RectBatch


@dataclass
class PooledRow:
    """One request between rounds: its content and, per layer, its K/V as [T, H, D] views."""

    request: int
    prompt_len: int
    budget_end: int
    tokens: torch.Tensor  # [content_len]
    target_kv: list
    draft_kv: list
    draft_pending: int  # tokens at the end of the content without draft K/V in draft_kv
    rounds: int = 0  # rounds this request has run

    @property
    def key(self) -> tuple:
        return (len(self.tokens), 1, self.draft_pending)


def unstack(batch: RectBatch) -> list[PooledRow]:
    """Views of each row of a batch (no copy)."""
    rows = []
    pending = batch.proposer.pending_columns(batch.width)  # the batch keeps a uniform draft width L - P
    for i in range(batch.size):
        pad = batch.width - int(batch.content_len[i])
        rows.append(PooledRow(
            int(batch.request[i]), int(batch.prompt_len[i]), int(batch.budget_end[i]), batch.tokens[i, pad:],
            row_views(batch.target_cache, i, pad), batch.proposer.row_kv(i, pad), pending, int(batch.rounds[i])))
    return rows


def stack(rows: list[PooledRow], target, draft, settings: Settings, stats: Stats, clock) -> RectBatch:
    """A rectangular batch of pool rows: tokens and caches left-padded to the longest row (I1)."""
    content = np.array([len(r.tokens) for r in rows])
    pending = max(r.draft_pending for r in rows)
    tokens = pad_sequence([r.tokens for r in rows], batch_first=True, padding_side="left",
                          padding_value=settings.pad_id)
    proposer = rect_proposer_class(draft).stacked(draft, settings, [r.draft_kv for r in rows], content, pending)
    return RectBatch(target, settings, stats, clock, request=np.array([r.request for r in rows]),
                     prompt_len=np.array([r.prompt_len for r in rows]), content_len=content,
                     budget_end=np.array([r.budget_end for r in rows]), tokens=tokens,
                     rounds=np.array([r.rounds for r in rows]),
                     target_cache=stacked_cache([r.target_kv for r in rows], list(content - 1)), proposer=proposer)


class Exspec:
    """EXSPEC: rows wait in a pool between rounds; each round stacks the largest group of rows with
    equal lengths (reference.pool.ExspecPool: options' pool_window and max_wait)."""
    layout = "rectangular"
    keeps_features = False

    def __init__(self, options):
        self.pool_window, self.max_wait = options.pool_window, options.max_wait

    def run(self, target, draft, prompts, max_new, settings: Settings, stats: Stats, clock, batch_size: int, on_done):
        pool = ExspecPool(batch_size, window=self.pool_window or 4 * batch_size, max_wait=self.max_wait)
        arrivals = settings.arrivals or Arrivals(len(prompts))
        stored: dict = {}
        batch, grouped_rounds, fallbacks = None, 0, 0
        round_index = 0
        while arrivals.pending() or pool.queue or pool.pool:
            for r in arrivals.due():
                pool.submit(r)
            if not pool.queue and not pool.pool:
                arrivals.wait()
                continue
            admitted = pool.admit()
            if admitted:  # prefilled on their own, in one batch, then split into the pool
                new = RectBatch.prefill([prompts[r] for r in admitted], admitted, [max_new[r] for r in admitted], target,
                                        draft, settings, stats, clock)
                with clock("time_align"):
                    for row in unstack(new):
                        stored[row.request] = row
                        pool.enter(row.request, row.key)
            with clock("time_align"):
                chosen, grouped = pool.select()
                if batch is None or list(batch.request) != chosen:
                    if batch is not None:
                        stored.update({row.request: row for row in unstack(batch)})
                    batch = stack([stored.pop(r) for r in chosen], target, draft, settings, stats, clock)
            grouped_rounds += grouped
            fallbacks += not grouped
            round_index += 1
            finished = set()
            for done in batch.round(round_index):
                on_done(*done)
                finished.add(done[0])
            with clock("time_align"):
                pending = batch.proposer.pending_columns(batch.width)
                keys = {int(r): (int(c), 1, pending) for r, c in zip(batch.request, batch.content_len)}
                pool.finish_round(keys, finished)
                if batch.size == 0:
                    batch = None
            settings.observer.check(lambda: check_conservation(range(arrivals.released), pool.members()))
            settings.observer.end_round(round_index)
        stats.extra.update(grouped_rounds=grouped_rounds, fallback_rounds=fallbacks,
                           group_rate=grouped_rounds / max(round_index, 1))
