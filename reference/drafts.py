"""Scripted drafts: produce any acceptance pattern on purpose.

`ScriptedDraft` wraps a model (usually the target itself, so it follows the target's greedy
continuation) and deviates wherever `deviate(next_index, token)` says so, by demoting the top
logit so that the second best token is proposed. `next_index` is the content index of the token
being predicted (position + 1), so a rule such as "deviate at indices 7 and 12" gives every row
its own ragged acceptance pattern when prompts have different lengths.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .toy_lm import NEG

DeviateRule = Callable[[np.ndarray, np.ndarray], np.ndarray]


def deviate_at(indices) -> DeviateRule:
    """Deviate when predicting any content index in `indices`."""
    wanted = np.asarray(sorted(set(int(i) for i in indices)), dtype=np.int64)
    return lambda next_index, token: np.isin(next_index, wanted)


def deviate_hashed(seed: int, rate: float) -> DeviateRule:
    """Deviate pseudo-randomly with probability `rate`, keyed by (seed, content index, input token)."""
    threshold = int(rate * 2**32)

    def rule(next_index, token):
        h = (np.asarray(next_index, dtype=np.uint64) * np.uint64(0x9E3779B1)
             + np.asarray(token, dtype=np.uint64) * np.uint64(0x85EBCA77) + np.uint64(seed * 0xC2B2AE3D + 1))
        h = (h ^ (h >> np.uint64(15))) * np.uint64(0x2C1B3C6D) % np.uint64(2**32)
        return h < np.uint64(threshold)

    return rule


def confidence_hashed(seed: int, low: float = 0.05, high: float = 0.95):
    """A confidence rule for scripted drafts: a pseudo-random probability in [low, high], keyed by
    (seed, content index, input token) like deviate_hashed (fast.proposals thresholds it)."""
    def rule(next_index, token):
        h = (np.asarray(next_index, dtype=np.uint64) * np.uint64(0x27D4EB2F)
             + np.asarray(token, dtype=np.uint64) * np.uint64(0x165667B1) + np.uint64(seed * 0x9E3779B9 + 7))
        h = (h ^ (h >> np.uint64(13))) * np.uint64(0x5BD1E995) % np.uint64(2**32)
        return low + (high - low) * h.astype(np.float64) / 2**32

    return rule


def demote_top(logits: np.ndarray, where: np.ndarray, swap: bool = False) -> np.ndarray:
    """Return logits where, at the entries `where` [B, Q], the argmax is pushed to the bottom (swap:
    trades places with the second best, which then leads)."""
    out = logits.copy()
    order = np.argsort(-out, axis=-1, kind="stable")
    top, second = order[..., 0], order[..., 1]
    b, q = np.nonzero(where)
    if swap:
        out[b, q, top[b, q]], out[b, q, second[b, q]] = logits[b, q, second[b, q]], logits[b, q, top[b, q]]
    else:
        out[b, q, top[b, q]] = NEG
    return out


class ScriptedDraft:
    """A draft model that agrees with `base` except where `deviate` fires; with a `confidence` rule
    (e.g. confidence_hashed) its confidence at each step is scripted too (the proposal rule, I7).
    Where it deviates, base's best token drops to the bottom, or with swap=True to second place (the
    draft's second guess is then base's first: what a token tree's leaves catch)."""

    def __init__(self, base, deviate: DeviateRule, confidence=None, swap: bool = False):
        self.base, self.deviate, self.confidence, self.swap = base, deviate, confidence, swap
        self.n_layers, self.dim, self.vocab_size = base.n_layers, base.dim, base.vocab_size
        self._last = None

    def empty_past(self, batch: int):
        return self.base.empty_past(batch)

    def forward(self, tokens, positions, past, mask):
        logits, new_kv = self.base.forward(tokens, positions, past, mask)
        self._last = (positions[:, -1] + 1, tokens[:, -1])  # what the last query predicts from
        return demote_top(logits, self.deviate(positions + 1, tokens), self.swap), new_kv

    def confidence_of(self, last_logits):
        """The confidence of the last forward's last query (the rule's value, or softmax's top)."""
        if self.confidence is None:
            shifted = last_logits - last_logits.max(axis=-1, keepdims=True)
            return 1.0 / np.exp(shifted).sum(axis=-1)
        return self.confidence(*self._last)

    def logits_of(self, sequence, window: int | None = None):
        seq = np.asarray(sequence, dtype=np.int64)
        logits = self.base.logits_of(seq, window)[None]
        return demote_top(logits, self.deviate(np.arange(1, len(seq) + 1)[None], seq[None]), self.swap)[0]

    def kv_of(self, sequence, window: int | None = None):
        return self.base.kv_of(sequence, window)
