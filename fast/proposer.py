"""The ragged engine's draft side behind one proposer interface (as HF's CandidateGenerator's
get_candidates / update_candidate_strategy, or vLLM's proposers).

A proposer owns what the draft keeps per slot row and nothing else: its K/V (a SlotCache), each
row's committed tokens not yet in that cache (`pending`), and for a draft that reads the target's
features (fast.feature_draft) the features of each row's content. The engine calls

    prefill(prompts, slots)                            newly placed requests, after the target's prefill
    propose(rows, content, remaining, requests, waiting) -> Proposals   this round's, per row
    update(rows, committed, accepted, proposals)       what each row committed (keeps I3 for the draft cache)
    move_row(src, dst, count)                          compaction
    check_cache(row, content)                          I3 on one row

Every kind of draft (a model, prompt lookup first, a restricted head, a feature head) is a
DraftProposer: what it can do comes from its declared abilities (fast.models.DraftAbilities), read
once here. NoDraft is the no-op proposer of target-only decoding.
"""
from __future__ import annotations

import numpy as np
import torch

from .attention import uses_engine_attention
from .engine import Proposals, Settings, check_cache_row, draft_round
from .feature_draft import FeatureBuffer, draft_pending_after_features
from .lookup_draft import LookupStep, latest_match
from .models import vocab_size
from .prefill import prefill_into
from .slot_cache import SlotCache
from .slot_forward import slot_forward, storage_dtype
from .verify import draft_pending_after


class NoDraft:
    """Target-only decoding: no row proposes, nothing is kept."""
    features = None

    def __init__(self, settings: Settings):
        self.settings = settings

    def prefill(self, prompts, slots) -> None:
        pass

    def propose(self, rows, content, remaining, requests, waiting) -> Proposals:
        s = self.settings
        return draft_round(None, s, np.zeros(len(rows), dtype=np.int64), requests,
                           torch.as_tensor(content, device=s.device), s.device, None, remaining, waiting)

    def update(self, rows, committed, accepted, proposals: Proposals) -> None:
        pass

    def move_row(self, src: int, dst: int, count: int) -> None:
        pass

    def check_cache(self, row: int, content: list) -> list:
        return []


class DraftProposer:
    """A draft model stepped over the engine's slot rows (engine.draft_round applies the policy's rule).

    tokens: the engine's token buffer [slots, capacity + 1], content index j of a row in column j
    (read only here)."""

    def __init__(self, draft, settings: Settings, tokens: torch.Tensor, slots: int, capacity: int):
        self.draft, self.settings, self.tokens = draft, settings, tokens
        dev = settings.device
        self.cache = SlotCache(draft.num_layers, slots, capacity, dev, storage_dtype(draft, settings))
        self.pending = np.ones(slots, dtype=np.int64)  # per slot: committed tokens without K/V in self.cache
        self.grouped = uses_engine_attention(draft.model)
        can = draft.abilities
        lookup_first = can.prompt_lookup is not None and settings.reads_confidence
        self.lookup = can.prompt_lookup if lookup_first else None  # lookup rows (draft_round) stop on confidence
        self.vocab = vocab_size(draft.model) if lookup_first else None
        # the draft step's own options: the engine's lookup replaces the draft's (one lookup a step), and
        # a restricted head's logits stay restricted (fast.reduced_head.SubsetLogits; greedy reads them as they are)
        self.options = {}
        if lookup_first:
            self.options["engine_lookup"] = True
        if can.returns_subset:
            self.options["subset_logits"] = True
        # a draft whose rows are independent and keep no K/V (the feature head) computes, at each step,
        # only the rows still drafting by the model (draft_round's `needed`)
        self.row_subset = can.computes_row_subset
        self.features = None  # the target's features of each row's content (written by the engine's capture)
        if can.reads_features:
            hidden = int(draft.model.config.hidden_size)
            self.features = FeatureBuffer(slots, capacity, hidden, settings.dtype, dev)

    def forward(self, query_index: np.ndarray, ids, features=None, rows=None):
        """The draft's logits at each row's last query; rows: the rows to compute (None: all)."""
        extra = dict(self.options)
        if features is not None:
            extra["features"] = features
        if rows is not None:
            extra["rows"] = rows
        out, _, _ = slot_forward(self.draft, self.cache, query_index, ids, self.settings, self.grouped,
                                 last_only=True, **extra)
        return out[:, -1]

    def prefill(self, prompts, slots) -> None:
        """Each prompt but its last token (pending) into the slot rows `slots` (a feature draft reads
        the features the target's prefill just wrote)."""
        route = None
        if self.features is not None:
            route = lambda rows, index: {"features": self.features.inputs(rows, index)}  # noqa: E731
        prefill_into(self.draft, self.cache, [p[:-1] for p in prompts], list(slots), [0] * len(prompts),
                     self.settings, route)
        self.pending[slots] = 1

    def propose(self, rows, content, remaining, requests, waiting) -> Proposals:
        """Each running row's proposals, at most min(k, remaining - 1) (I5's budget side)."""
        s = self.settings
        dev = lambda a: torch.as_tensor(a, device=s.device)  # noqa: E731
        rows_dev = dev(rows)
        clamp = np.minimum(s.k, remaining - 1)
        pending = int(self.pending[rows].max())

        def step_forward(step, ids, needed):
            features, subset = None, None
            if self.row_subset and not needed.all():
                subset = dev(np.nonzero(needed)[0])
            if ids is None:  # re-feed each row's last `pending` tokens (identical K/V where already cached)
                query_index = content[:, None] - pending + np.arange(pending)[None, :]
                ids = self.tokens[rows_dev[:, None], dev(np.maximum(query_index, 0))]
                if self.features is not None:  # the target's f_{j-1} for each re-fed token j
                    features = self.features.inputs(rows_dev[:, None], dev(np.maximum(query_index, 0)))
            else:
                query_index = content[:, None] + step - 1
                estimate = self.draft.last_features
                if self.features is not None and estimate is not None:  # past the content: the draft's own
                    features = estimate[:, -1:]                            # estimate from the step before
            return self.forward(query_index, ids, features, subset)

        lookup = self.lookup_step(rows_dev, content) if self.lookup is not None else None
        return draft_round(step_forward, s, clamp, requests, dev(content), s.device, lookup, remaining, waiting)

    def lookup_step(self, rows_dev, content: np.ndarray):
        """draft_round's lookup_step for this round's rows: the lookup-first draft's prompt lookup over
        each row's tokens (content 0..c_i - 1, then the round's proposals), run on the token buffer
        itself (no cache: a round of lookup rows alone leaves the draft's cache as it is)."""
        s, rows = self.settings, len(content)
        width = int(content.max()) + s.k
        work = self.tokens[rows_dev, :width].clone()
        length = torch.as_tensor(content, device=s.device)
        column = torch.arange(width, device=s.device)[None, :]
        row_index = torch.arange(rows, device=s.device)

        def step(step, ids):
            if ids is not None:  # the previous step's tokens follow each row's content
                work[row_index, length + step - 1] = ids[:, 0]
            history = torch.where(column < (length + step)[:, None], work, torch.full_like(work, -1))
            proposal, matched = latest_match(history, length + step - 1, self.lookup.max_ngram, self.lookup.min_match)
            return LookupStep(proposal, matched, self.vocab, s.dtype)
        return step

    def update(self, rows, committed, accepted, proposals: Proposals) -> None:
        """Told what each row committed: the draft cache keeps K/V of content[:c - pending] (I3)."""
        if self.features is not None:  # K/V from the draft's own feature estimates are never kept
            self.pending[rows] = draft_pending_after_features(committed, proposals.model_steps, self.pending[rows])
        else:
            self.pending[rows] = draft_pending_after(committed, accepted, proposals.model_steps, self.pending[rows])

    def move_row(self, src: int, dst: int, count: int) -> None:
        self.cache.move_row(src, dst, count)
        self.pending[dst] = self.pending[src]
        if self.features is not None:
            self.features.move_row(src, dst, count)

    def check_cache(self, row: int, content: list) -> list:
        """I3 for one slot row: it holds a fresh prefill's K/V of content[:len - pending]."""
        prefix = content[:len(content) - int(self.pending[row])]
        features = None
        if self.features is not None:  # the fresh prefill reads the recorded features
            dev = self.settings.device
            features = self.features.inputs(torch.full((1, len(prefix)), row, device=dev),
                                            torch.arange(len(prefix), device=dev)[None])
        return check_cache_row(self.draft, lambda layer: self.cache.slot_values(layer, row, len(prefix)), row,
                               prefix, 0, self.settings, "draft cache", features)


def proposer_for(draft, settings: Settings, tokens: torch.Tensor, slots: int, capacity: int):
    """The ragged engine's proposer: DraftProposer for a draft, NoDraft for target-only decoding."""
    return NoDraft(settings) if draft is None else DraftProposer(draft, settings, tokens, slots, capacity)
