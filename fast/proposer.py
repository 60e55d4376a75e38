"""The ragged engine's draft side behind one proposer interface (as HF's CandidateGenerator's
get_candidates / update_candidate_strategy, or vLLM's proposers).

A proposer owns what the draft keeps per slot row and nothing else: its K/V (a SlotCache), each
row's committed tokens not yet in that cache (`pending`), and for a draft that reads the target's
features (fast.drafts.feature_draft) the features of each row's content. The engine calls

    prefill(prompts, slots)                            newly placed requests, after the target's prefill
    propose(rows, content, remaining, requests, waiting) -> Proposals   this round's, per row
    update(rows, committed, accepted, proposals)       what each row committed (keeps I3 for the draft cache)
    move_row(src, dst, count)                          compaction
    release()                                          the generation is over: its cache buffers go back
    check_cache(row, content)                          I3 on one row

One class per kind of draft side, chosen by `proposer_for` from the draft's declared abilities
(fast.models.DraftAbilities, read once here):

    NoDraft          target-only decoding: no row proposes, nothing is kept
    DraftProposer    a draft model over the slot rows (a token draft, prompt lookup alone, a
                     restricted head handing the chooser its subset's logits)
    LookupFirst      wraps either of the two for a draft that declares its own prompt lookup
                     (fast.drafts.lookup_draft.LookupFirstDraft) under a policy that reads confidences: the
                     engine runs that lookup over the token buffer, and rows whose lookup matches
                     draft by lookup alone
    FeatureProposer  a draft that reads the target's features (fast.drafts.feature_draft): it also keeps
                     each row's features, and K/V made from its own feature estimates never stay
"""
from __future__ import annotations

import numpy as np
import torch

from .compute.attention import uses_engine_attention
from .engine import Proposals, Settings, check_cache_row, draft_round
from .drafts.feature_draft import FeatureBuffer, draft_pending_after_features
from .drafts.lookup_draft import LookupStep, latest_match, other_followers
from .models import vocab_size
from .compute.prefill import prefill_into
from .compute.slot_cache import SlotCache
from .compute.slot_forward import slot_forward, storage_dtype
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

    def release(self) -> None:
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
        # the draft step's own options: a restricted head's logits stay restricted
        # (fast.drafts.reduced_head.SubsetLogits; greedy reads them as they are)
        self.options = {}
        if can.returns_subset:
            self.options["subset_logits"] = True
        # a draft whose rows are independent and keep no K/V (the feature head) computes, at each step,
        # only the rows still drafting by the model (draft_round's `needed`)
        self.row_subset = can.computes_row_subset
        self.features = None  # FeatureProposer: the target's features of each row's content

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
        prefill_into(self.draft, self.cache, [p[:-1] for p in prompts], list(slots), [0] * len(prompts),
                     self.settings, self._prefill_route())
        self.pending[slots] = 1

    def propose(self, rows, content, remaining, requests, waiting, lookup_step=None) -> Proposals:
        """Each running row's proposals, at most min(k, remaining - 1) (I5's budget side);
        lookup_step: engine.draft_round's (LookupFirst)."""
        s = self.settings
        dev = lambda a: torch.as_tensor(a, device=s.device)  # noqa: E731
        rows_dev = dev(rows)
        clamp = np.minimum(s.k, remaining - 1)
        pending = int(self.pending[rows].max())

        def step_forward(step, ids, needed):
            subset = dev(np.nonzero(needed)[0]) if self.row_subset and not needed.all() else None
            refeed = ids is None
            if refeed:  # re-feed each row's last `pending` tokens (identical K/V where already cached)
                query_index = content[:, None] - pending + np.arange(pending)[None, :]
                ids = self.tokens[rows_dev[:, None], dev(np.maximum(query_index, 0))]
            else:
                query_index = content[:, None] + step - 1
            return self.forward(query_index, ids, self._step_features(rows_dev, query_index, refeed), subset)

        return draft_round(step_forward, s, clamp, requests, dev(content), s.device, lookup_step, remaining, waiting)

    def update(self, rows, committed, accepted, proposals: Proposals) -> None:
        """Told what each row committed: the draft cache keeps K/V of content[:c - pending] (I3)."""
        self.pending[rows] = draft_pending_after(committed, accepted, proposals.model_steps, self.pending[rows])

    def move_row(self, src: int, dst: int, count: int) -> None:
        self.cache.move_row(src, dst, count)
        self.pending[dst] = self.pending[src]

    def release(self) -> None:
        """The generation is over: the draft cache's buffers go back (fast.compute.slot_cache.SPARES)."""
        self.cache.release()

    def check_cache(self, row: int, content: list) -> list:
        """I3 for one slot row: it holds a fresh prefill's K/V of content[:len - pending]."""
        prefix = content[:len(content) - int(self.pending[row])]
        return check_cache_row(self.draft, lambda layer: self.cache.slot_values(layer, row, len(prefix)), row,
                               prefix, 0, self.settings, "draft cache", self._prefix_features(row, len(prefix)))

    # what a draft that reads no features passes along: nothing (FeatureProposer overrides these)
    def _prefill_route(self):
        return None

    def _step_features(self, rows_dev, query_index, refeed: bool):
        return None

    def _prefix_features(self, row: int, length: int):
        return None


class LookupFirst:
    """A lookup-first draft (fast.drafts.lookup_draft.LookupFirstDraft) under a policy that reads confidences,
    around the proposer of the draft model it wraps (`model_side`, which keeps every cache): the engine
    runs the draft's prompt lookup over the token buffer, one lookup a step, in place of the draft's
    own (its step runs with engine_lookup=True); a row whose lookup matches at step 0 drafts by lookup
    alone and stops where the chain of matches breaks (engine.draft_round)."""

    def __init__(self, model_side: DraftProposer, draft, settings: Settings, tokens: torch.Tensor):
        self.model_side, self.settings, self.tokens = model_side, settings, tokens
        self.lookup = draft.abilities.prompt_lookup
        self.vocab = vocab_size(draft.model)
        self.features = model_side.features
        model_side.options["engine_lookup"] = True

    def propose(self, rows, content, remaining, requests, waiting) -> Proposals:
        rows_dev = torch.as_tensor(rows, device=self.settings.device)
        return self.model_side.propose(rows, content, remaining, requests, waiting, self.lookup_step(rows_dev, content))

    def prefill(self, prompts, slots) -> None:
        self.model_side.prefill(prompts, slots)

    def update(self, rows, committed, accepted, proposals: Proposals) -> None:
        self.model_side.update(rows, committed, accepted, proposals)

    def move_row(self, src: int, dst: int, count: int) -> None:
        self.model_side.move_row(src, dst, count)

    def release(self) -> None:
        self.model_side.release()

    def check_cache(self, row: int, content: list) -> list:
        return self.model_side.check_cache(row, content)

    def lookup_step(self, rows_dev, content: np.ndarray):
        """draft_round's lookup_step for this round's rows: the draft's prompt lookup over each row's
        tokens (content 0..c_i - 1, then the round's proposals), run on the token buffer itself (no
        cache: a round of lookup rows alone leaves the draft's cache as it is). With token trees, where
        the chooser allows it (greedy and coupled), each step also brings the followers of the matched
        n-gram's other occurrences: a lookup row's leaves (fast.trees)."""
        s, rows = self.settings, len(content)
        most = s.tree_branches - 1 if s.chooser.takes_lookup_leaves else 0  # leaves a lookup row may bring
        width = int(content.max()) + s.k
        work = self.tokens[rows_dev, :width].clone()
        length = torch.as_tensor(content, device=s.device)
        column = torch.arange(width, device=s.device)[None, :]
        row_index = torch.arange(rows, device=s.device)

        def step(step, ids):
            if ids is not None:  # the previous step's tokens follow each row's content
                work[row_index, length + step - 1] = ids[:, 0]
            history = torch.where(column < (length + step)[:, None], work, torch.full_like(work, -1))
            last = length + step - 1
            proposal, matched = latest_match(history, last, self.lookup.max_ngram, self.lookup.min_match)
            if not most:
                return LookupStep(proposal, matched, self.vocab, s.dtype)
            others, shares = other_followers(history, last, proposal, matched, most, self.lookup.max_ngram)
            return LookupStep(proposal, matched, self.vocab, s.dtype, others, shares)
        return step


class FeatureProposer(DraftProposer):
    """A draft that reads the target's features (fast.drafts.feature_draft): each slot row also keeps the
    target's features of its content (written by the engine's capture during the target's prefill and
    verify), which the draft reads at every re-fed token; past the content it reads its own estimate
    from the step before, so the K/V those steps leave are never kept."""

    def __init__(self, draft, settings: Settings, tokens: torch.Tensor, slots: int, capacity: int):
        super().__init__(draft, settings, tokens, slots, capacity)
        hidden = int(draft.model.config.hidden_size)
        self.features = FeatureBuffer(slots, capacity, hidden, settings.dtype, settings.device)

    def update(self, rows, committed, accepted, proposals: Proposals) -> None:
        """K/V from the draft's own feature estimates are never kept (I3)."""
        self.pending[rows] = draft_pending_after_features(committed, proposals.model_steps, self.pending[rows])

    def move_row(self, src: int, dst: int, count: int) -> None:
        super().move_row(src, dst, count)
        self.features.move_row(src, dst, count)

    def _prefill_route(self):
        return lambda rows, index: {"features": self.features.inputs(rows, index)}

    def _step_features(self, rows_dev, query_index, refeed: bool):
        if refeed:  # the target's f_{j-1} for each re-fed token j
            index = torch.as_tensor(np.maximum(query_index, 0), device=self.settings.device)
            return self.features.inputs(rows_dev[:, None], index)
        estimate = self.draft.last_features  # past the content: the draft's own estimate from the step before
        return None if estimate is None else estimate[:, -1:]

    def _prefix_features(self, row: int, length: int):
        """The recorded features a fresh prefill of the row's cached prefix reads (check_cache)."""
        dev = self.settings.device
        return self.features.inputs(torch.full((1, length), row, device=dev), torch.arange(length, device=dev)[None])


def proposer_for(draft, settings: Settings, tokens: torch.Tensor, slots: int, capacity: int):
    """The ragged engine's proposer for `draft`: NoDraft for target-only decoding, FeatureProposer for a
    draft that reads the target's features, DraftProposer for every other draft; either inside
    LookupFirst for a draft with its own prompt lookup under a policy that reads confidences."""
    if draft is None:
        return NoDraft(settings)
    can = draft.abilities
    kind = FeatureProposer if can.reads_features else DraftProposer
    proposer = kind(draft, settings, tokens, slots, capacity)
    if can.prompt_lookup is not None and settings.reads_confidence:
        return LookupFirst(proposer, draft, settings, tokens)
    return proposer
