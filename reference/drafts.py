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


def demote_top(logits: np.ndarray, where: np.ndarray) -> np.ndarray:
    """Return logits where, at the entries `where` [B, Q], the argmax is pushed to the bottom."""
    out = logits.copy()
    top = np.argmax(out, axis=-1)
    b, q = np.nonzero(where)
    out[b, q, top[b, q]] = NEG
    return out


class ScriptedDraft:
    """A draft model that agrees with `base` except where `deviate` fires."""

    def __init__(self, base, deviate: DeviateRule):
        self.base, self.deviate = base, deviate
        self.n_layers, self.dim, self.vocab_size = base.n_layers, base.dim, base.vocab_size

    def empty_past(self, batch: int):
        return self.base.empty_past(batch)

    def forward(self, tokens, positions, past, mask):
        logits, new_kv = self.base.forward(tokens, positions, past, mask)
        return demote_top(logits, self.deviate(positions + 1, tokens)), new_kv

    def logits_of(self, sequence):
        seq = np.asarray(sequence, dtype=np.int64)
        logits = self.base.logits_of(seq)[None]
        return demote_top(logits, self.deviate(np.arange(1, len(seq) + 1)[None], seq[None]))[0]

    def kv_of(self, sequence):
        return self.base.kv_of(sequence)
