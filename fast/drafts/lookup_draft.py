"""Training-free drafting by prompt lookup (n-gram matching), shaped as a causal LM.

The lookup's "key" for a token is the token id itself, with no value: the engine's cache then holds
each row's history exactly like real K/V, in any layout (padded, realigned, ragged), and the 4D mask
tells the lookup which slots are the row's content. For the last query of each row it finds the
most recent earlier occurrence of the row's last n tokens (n = max_ngram .. 1) in the visible
history and proposes the token that followed it. It costs a few tensor operations per step, so it
buys speed whenever a text repeats itself (summaries, code, retrieval answers), and like any draft
it cannot change the output (proofs_notes/).

`PromptLookupDraft` is the lookup alone (its confidence: certain for a match of 2+ tokens, 0.2 for
a single token, barely above uniform without a match, where it falls back to the last token);
`LookupFirstDraft` puts it in front of a real draft model, which proposes wherever no n-gram of at
least `min_match` tokens matches. With token trees (fast.trees) a row of a lookup-first draft that
drafts by lookup also offers, as leaves, what followed the matched n-gram's other earlier
occurrences (`other_followers`).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..models import WeightlessLM, abilities_of, cache_argument
from .reduced_head import full_logits


def store_history(cache, layer: int, input_ids) -> torch.Tensor:
    """Store the query tokens in cache layer `layer` as their K and V; returns the layer's keys
    [B, 1, S, 1] (token ids as floats, whatever the mask hides included)."""
    ids = input_ids.to(torch.float32)[:, None, :, None]  # [B, 1, Q, 1]: one "head", one feature
    history, _ = cache.update(ids, ids, layer)
    return history


def lookup(cache, layer: int, input_ids, attention_mask, max_ngram: int, min_ngram: int = 1):
    """Store the query tokens in cache layer `layer` and look up each row's continuation.

    Returns (proposal [B], matched [B]): the token after the latest earlier match of the row's last
    n tokens, n from max_ngram down to min_ngram, and that n (0 and the row's last token when nothing
    matches). Visible slots (mask 0 for the last query) form a contiguous range ending at the query."""
    history = store_history(cache, layer, input_ids)[:, 0, :, 0].round().long()  # [B, S]
    visible = attention_mask[:, 0, -1, :] == 0
    token = torch.where(visible, history, torch.full_like(history, -1))
    position = torch.arange(history.shape[1], device=history.device)[None, :]
    last = (visible.long() * position).argmax(dim=1)  # the query's slot
    return latest_match(token, last, max_ngram, min_ngram)


def ngram_matches(token, last, n: int) -> torch.Tensor:
    """[B, S] bool: the slots j < last[i] that end an earlier occurrence of row i's last n tokens
    (token [B, S], -1 where hidden, never matches)."""
    position = torch.arange(token.shape[1], device=token.device)[None, :]
    match = (position < last[:, None]) & (position >= n - 1)
    for offset in range(n):  # token[j - offset] == token[last - offset]
        shifted = torch.roll(token, offset, dims=1)
        target = token.gather(1, (last - offset).clamp(min=0)[:, None])
        match &= (shifted == target) & (target >= 0)
    return match


def latest_match(token, last, max_ngram: int, min_ngram: int = 1):
    """token [B, S]: each row's history (-1 where hidden), last [B]: the slot of its last token.
    Returns (proposal [B], matched [B]) as `lookup` describes."""
    batch, slots = token.shape
    position = torch.arange(slots, device=token.device)[None, :]
    proposal = token.gather(1, last[:, None])[:, 0]
    matched = torch.zeros(batch, dtype=torch.long, device=token.device)
    for n in range(max_ngram, min_ngram - 1, -1):
        match = ngram_matches(token, last, n)
        j = (match.long() * (position + 1)).argmax(dim=1)  # the latest j (0 when none)
        has = match.any(dim=1) & (matched == 0)
        follower = token.gather(1, (j + 1).clamp(max=slots - 1)[:, None])[:, 0]
        proposal = torch.where(has, follower, proposal)
        matched = torch.where(has, torch.full_like(matched, n), matched)
    return proposal.clamp(min=0), matched  # a pad query (nothing visible) proposes token 0


def other_followers(token, last, proposal, matched, count: int, max_ngram: int):
    """A lookup's candidates beside its proposal, for a token tree's leaves (fast.trees): the tokens
    that followed the other earlier occurrences of the row's matched n-gram (n = matched[i]), latest
    first, distinct and never the proposal, with each one's share of those occurrences. Returns
    (others [B, count], share [B, count]); where a row has fewer (or did not match), the proposal
    and share 0 fill the rest, so a row's alternatives are its leading ones with share > 0."""
    position = torch.arange(token.shape[1], device=token.device)[None, :]
    follower = torch.roll(token, -1, dims=1)  # follower[j] = token[j + 1] (j < last: inside the history)
    occurrence = torch.zeros_like(token, dtype=torch.bool)
    for n in range(1, max_ngram + 1):
        occurrence |= ngram_matches(token, last, n) & (matched == n)[:, None]
    total = occurrence.sum(dim=1).clamp(min=1)
    taken, others, shares = proposal[:, None], [], []
    for _ in range(count):
        free = occurrence & (follower[:, :, None] != taken[:, None, :]).all(dim=2)
        j = (free.long() * (position + 1)).argmax(dim=1)
        has = free.any(dim=1)
        other = torch.where(has, follower.gather(1, j[:, None])[:, 0], proposal)
        share = (occurrence & (follower == other[:, None])).sum(dim=1) / total
        others.append(other)
        shares.append(torch.where(has, share, torch.zeros_like(share)))
        taken = torch.cat([taken, other[:, None]], dim=1)
    return torch.stack(others, dim=1), torch.stack(shares, dim=1)


def one_hot_where_matched(logits, proposal, matched):
    """logits [B, V] with every row whose lookup matched (matched > 0) made one-hot on its proposal
    (0 there, -1e4 elsewhere), in place; the other rows keep their logits."""
    hit = (matched > 0)[:, None]
    kept = logits.gather(1, proposal[:, None])
    logits.masked_fill_(hit, -1e4)
    return logits.scatter_(1, proposal[:, None], torch.where(hit, torch.zeros_like(kept), kept))


@dataclass
class LookupStep:
    """One step of a prompt lookup over a batch: each row's proposal [R] and its matched n-gram
    length [R] (0: no match). As draft logits (`logits()`) a matched row is one-hot on its proposal
    and an unmatched row uniform; fast.sampling's choosers read greedy proposals straight from the
    two tensors (Chooser.draft_lookup), so a step of lookup rows alone builds no [R, V] logits."""

    proposal: torch.Tensor
    matched: torch.Tensor
    vocab: int
    dtype: torch.dtype = torch.float32
    others: torch.Tensor | None = None  # [R, b - 1] a token tree's leaves for lookup rows (other_followers)
    shares: torch.Tensor | None = None  # [R, b - 1] their shares of the n-gram's occurrences (0: none)

    def logits(self) -> torch.Tensor:
        uniform = torch.zeros(len(self.proposal), self.vocab, dtype=self.dtype, device=self.proposal.device)
        return one_hot_where_matched(uniform, self.proposal, self.matched)


def confidence_height(confidence: float, vocab: int) -> float:
    """The logit h (others 0) at which one token has softmax probability `confidence`."""
    return math.log(confidence * (vocab - 1) / (1 - confidence))


class PromptLookupDraft(WeightlessLM):
    ranks_candidates = False  # one proposal per step, the rest uniform: a token tree has no leaves to take

    def __init__(self, vocab_size: int, max_ngram: int = 3, device="cpu", generation_config=None):
        super().__init__(vocab_size, "prompt-lookup", generation_config)
        self.max_ngram = max_ngram
        self.register_buffer("_anchor", torch.zeros(1, device=device))  # gives the module a device

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, cache=None, use_cache=True,
                logits_to_keep=0, **kwargs):
        batch, queries = input_ids.shape
        proposal, matched = lookup(cache, 0, input_ids, attention_mask, self.max_ngram)
        keep = queries if not logits_to_keep else min(int(logits_to_keep), queries)
        # the proposal's confidence (fast.proposals) grows with the matched n-gram: 2 or more tokens are
        # taken as certain, a single token as a weak guess (0.2), no match as barely above uniform
        vocab = self.config.vocab_size
        height = torch.full(matched.shape, confidence_height(1.5 / vocab, vocab), device=input_ids.device)
        height = torch.where(matched == 1, confidence_height(0.2, vocab), height)
        height = torch.where(matched >= 2, torch.full_like(height, 1e4), height)
        logits = torch.zeros(batch, keep, self.config.vocab_size, device=input_ids.device)
        logits.scatter_(2, proposal[:, None, None].expand(batch, keep, 1), height[:, None, None].expand(batch, keep, 1))
        return SimpleNamespace(logits=logits)


class LookupFirstDraft(torch.nn.Module):
    """A draft model behind a prompt lookup: where the row's last `min_match` or more tokens occurred
    earlier in its history the lookup's token is proposed (its logits become one-hot), elsewhere the
    model's. The token history is one extra cache layer after the model's own layers, so every
    layout keeps it, realigns it and masks it exactly like the model's K/V (I1-I4 hold unchanged)."""

    def __init__(self, model, min_match: int = 2, max_ngram: int = 3):
        super().__init__()
        self.model, self.min_match, self.max_ngram = model, min_match, max_ngram
        self.cache_kw = cache_argument(model)
        self.config = copy.copy(model.config)
        self.config.num_hidden_layers = model.config.num_hidden_layers + 1
        if getattr(model.config, "layer_types", None):
            self.config.layer_types = list(model.config.layer_types) + [model.config.layer_types[-1]]
        self.generation_config = model.generation_config
        self._lookup_count = torch.zeros((), dtype=torch.long)  # a device tensor: no host sync per step

    @property
    def device(self):
        return self.model.device

    @property
    def reads_features(self) -> bool:
        """Whether the model behind the lookup reads the target's features (fast.drafts.feature_draft)."""
        return abilities_of(self.model).reads_features

    @property
    def returns_subset(self) -> bool:
        """Whether forward(subset_logits=True) is understood (by the model behind the lookup)."""
        return abilities_of(self.model).returns_subset

    @property
    def computes_row_subset(self) -> bool:
        """Whether forward(rows=...) is understood (by the model behind the lookup; the history layer
        is stored for every row either way)."""
        return abilities_of(self.model).computes_row_subset

    @property
    def ranks_candidates(self) -> bool:
        """Whether the model behind the lookup ranks candidates (token trees' leaves, fast.trees)."""
        return abilities_of(self.model).ranks_candidates

    @property
    def prompt_lookup(self):
        """Its lookup (min_match, max_ngram), which the ragged engine runs itself for lookup rows."""
        return self

    @property
    def lookup_proposals(self) -> int:
        """Last-query rows whose proposal came from the lookup so far (a statistic)."""
        return int(self._lookup_count)

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, cache=None, use_cache=True,
                logits_to_keep=0, engine_lookup=False, **kwargs):
        """engine_lookup=True: the caller runs the same lookup itself (the ragged engine's lookup rows,
        engine.draft_round, which puts its proposals where it matched): the tokens are stored in the
        history layer, and the model's logits come back untouched (SubsetLogits too, if asked for)."""
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         use_cache=True, logits_to_keep=logits_to_keep, **{self.cache_kw: cache}, **kwargs)
        if engine_lookup:
            store_history(cache, self.model.config.num_hidden_layers, input_ids)
            return SimpleNamespace(logits=out.logits, features=getattr(out, "features", None))
        logits = full_logits(out.logits)
        proposal, matched = lookup(cache, self.model.config.num_hidden_layers, input_ids, attention_mask,
                                   self.max_ngram, min_ngram=self.min_match)
        from_lookup = matched > 0
        self._lookup_count = self._lookup_count.to(from_lookup.device) + from_lookup.sum()
        one_hot_where_matched(logits[:, -1], proposal, matched)
        return SimpleNamespace(logits=logits, features=getattr(out, "features", None))
