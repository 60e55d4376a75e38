"""EQSPEC's and EXSPEC's draft side behind the proposer interface (fast.proposer is the ragged
engine's): what the draft keeps for a left-padded rectangular batch, and nothing else.

The draft's DynamicCache covers columns [0, L - P) of every row alike, P = `uniform_pending(L)`,
the rows' largest pending count (committed tokens without draft K/V: 1, or 2 after a full accept).
A row with less loses the K/V in between, recomputed when its first draft step re-feeds the last P
columns; a row shorter than P has nothing cached, and its pad columns among those P are pad queries.
The batch calls

    propose(forward, tokens, clamp, requests, content) -> Proposals   this round's, per row
    realign(width, n, accepted, proposals, keep, rows, source, new_width)   the batch's EQSPEC update
    row_kv(row, pad) / pending_columns(width)                           EXSPEC's pool views
    check_cache(row, content, pad)                                      I3 on one row

NoRectDraft is target-only decoding (no row proposes, nothing is kept), RectProposer a draft model;
rect_proposer_class(draft) chooses.
"""
from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache

from .compute.cache import cache_width, gather_cache, row_views, stacked_cache
from .engine import Proposals, Settings, check_cache_row, draft_round, dynamic_layer_kv
from .compute.prefill import prefill_rectangle
from .verify import draft_pending_after


class NoRectDraft:
    """Target-only decoding of a rectangular batch: no row proposes, nothing is kept."""

    def __init__(self, settings: Settings):
        self.settings = settings

    @classmethod
    def prefilled(cls, draft, settings: Settings, contents, width):
        return cls(settings)

    @classmethod
    def stacked(cls, draft, settings: Settings, rows_kv, content, pending):
        return cls(settings)

    def propose(self, forward, tokens, clamp, requests, content) -> Proposals:
        s = self.settings
        return draft_round(None, s, np.zeros(len(clamp), dtype=np.int64), requests, content, s.device)

    def realign(self, width, n, accepted, proposals, keep, rows, source, new_width) -> None:
        pass

    def pending_columns(self, width: int) -> int:
        return 1

    def row_kv(self, row: int, pad: int) -> list:
        return []

    def check_cache(self, row: int, content: list, pad: int) -> list:
        return []


class RectProposer:
    """A draft model over a left-padded batch: cache [B, H, L - P, D] per layer, pending [B] per row."""

    def __init__(self, draft, settings: Settings, cache: DynamicCache, pending: np.ndarray):
        self.draft, self.settings, self.cache, self.pending = draft, settings, cache, pending

    @classmethod
    def prefilled(cls, draft, settings: Settings, contents: list[list[int]], width: int):
        """Each row's content (its prompt but the pending last token) right-aligned in `width` columns."""
        return cls(draft, settings, prefill_rectangle(draft, contents, width, settings),
                   np.ones(len(contents), dtype=np.int64))

    @classmethod
    def stacked(cls, draft, settings: Settings, rows_kv: list, content: np.ndarray, pending: int):
        """Pool rows' K/V views stacked: each row keeps its first content - pending entries, left-padded."""
        return cls(draft, settings, stacked_cache(rows_kv, list(np.maximum(content - pending, 0))),
                   np.full(len(rows_kv), pending, dtype=np.int64))

    def uniform_pending(self, width: int) -> int:
        return min(int(self.pending.max()), width)

    def propose(self, forward, tokens: torch.Tensor, clamp, requests, content) -> Proposals:
        """forward(runner, ids, first_col, cache) -> logits [B, Q, V]: the batch's left-padded forward
        of query columns first_col.. (I1, I2); the first step re-feeds every row's last P columns."""
        s, width = self.settings, tokens.shape[1]
        pending = self.uniform_pending(width)
        first = [width - pending]

        def step_forward(step, ids, needed):  # every row is computed (its draft keeps K/V)
            ids = tokens[:, width - pending:] if ids is None else ids
            logits = forward(self.draft, ids, first[0], self.cache)
            first[0] += ids.shape[1]
            return logits[:, -1]

        return draft_round(step_forward, s, clamp, requests, content, s.device)

    def realign(self, width, n, accepted, proposals: Proposals, keep, rows, source, new_width) -> None:
        """The batch's EQSPEC update on the draft cache: keep `rows` (None: all), gather columns
        `source` (None: a crop) up to the new uniform draft width L' - P'."""
        pending = draft_pending_after(n, accepted, proposals.model_steps, np.full(len(n), self.uniform_pending(width)))
        gather_cache(self.cache, rows, source, max(new_width - int(pending[keep].max()), 0))
        self.pending = pending[keep]

    def pending_columns(self, width: int) -> int:
        """P as the cache shows it: the batch's columns past the draft cache."""
        return width - cache_width(self.cache)

    def row_kv(self, row: int, pad: int) -> list:
        """Views (no copy) of one row's K/V per layer, [T, H, D] from its first content column."""
        return row_views(self.cache, row, pad)

    def check_cache(self, row: int, content: list, pad: int) -> list:
        """I3: the row's cached columns hold a fresh prefill's K/V of its content's prefix."""
        cached = max(cache_width(self.cache) - pad, 0)
        return check_cache_row(self.draft, dynamic_layer_kv(self.cache, row), row, content[:cached], pad,
                               self.settings, "draft cache")


def rect_proposer_class(draft):
    """A batch's draft side: NoRectDraft for target-only decoding, else RectProposer."""
    return NoRectDraft if draft is None else RectProposer
