"""Logit processors and stop strings in NumPy: what a request's settings do to the target's logits.

One request's next-token logits are processed from its prefix alone, in this order
(docs/api.md#processors gives the sources):

  1. logit_bias          bias[t] added to logit t (OpenAI's definition).
  2. min_tokens          every EOS id of the request at -inf while fewer than min_tokens new tokens
                         exist (vLLM's and transformers' MinNewTokensLength definition).
  3. repetition_penalty  r for every token in the prompt or the new tokens: a positive logit is
                         divided by r, a negative one multiplied (transformers' and vLLM's definition).
  4. presence_penalty,   subtracted per token of the new tokens: frequency x count + presence x
     frequency_penalty   [count > 0] (OpenAI's definition; vLLM's is the same).

Greedy decoding takes the argmax of the processed logits. Sampling then divides by the temperature
and keeps the top-k, the top-p set and finally the tokens of probability at least min_p times the
most likely one (transformers' warper order; min_p commutes with top-k but not with top-p).

A stop string ends a request at the token whose decoding completes it: the returned tokens end with
that token, the text ends just before the stop string, and nothing after is returned.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np


@dataclass(frozen=True)
class Processors:
    """One request's processor settings; the defaults change nothing."""

    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)  # token id -> added logit
    min_tokens: int = 0
    min_p: float = 0.0
    stop: tuple = ()  # strings

    @property
    def changes_logits(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias) or self.min_tokens > 0)


PROCESSOR_SETTINGS = tuple(f.name for f in fields(Processors))  # every processor setting, by name


def process_logits(logits, prompt, generated, proc: Processors, eos_ids=()) -> np.ndarray:
    """Steps 1-4 on one position's logits [V] given the prompt and the new tokens before it."""
    x = np.array(logits, dtype=np.float64)
    for token, bias in proc.logit_bias.items():
        x[int(token)] += bias
    if len(generated) < proc.min_tokens:
        for e in eos_ids:
            x[int(e)] = -np.inf
    if proc.repetition_penalty != 1.0:
        seen = sorted(set(int(t) for t in prompt) | set(int(t) for t in generated))
        x[seen] = np.where(x[seen] > 0, x[seen] / proc.repetition_penalty, x[seen] * proc.repetition_penalty)
    counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=len(x))[:len(x)]
    x = x - proc.frequency_penalty * counts - proc.presence_penalty * (counts > 0)
    return x


def sampling_distribution(logits, temperature: float, top_k=None, top_p=None, min_p: float = 0.0) -> np.ndarray:
    """Probabilities [V] after temperature, top-k (ties kept), top-p (smallest most-likely set whose
    mass reaches p) and min_p (probability >= min_p x the largest), renormalised."""
    x = np.asarray(logits, dtype=np.float64)
    x = (x - x.max()) / temperature
    keep = np.isfinite(x)
    if top_k is not None and top_k < len(x):
        keep &= x >= np.sort(x)[-top_k]
    probs = np.where(keep, np.exp(x), 0.0)
    probs /= probs.sum()
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        drop = np.zeros(len(x), dtype=bool)
        drop[order] = before >= top_p
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum()
    if min_p:
        probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


def stop_cut(generated, decode, stops, before: int = 0) -> int | None:
    """The number of new tokens up to and including the one whose decoding completes a stop string;
    None when no stop string occurs. The first `before` tokens hold none (they were judged already).
    decode: token ids -> text (the request's tokenizer)."""
    if not stops:
        return None
    for m in range(before + 1, len(generated) + 1):
        text = decode(list(generated[:m]))
        if any(s in text for s in stops):
            return m
    return None


def stop_text(text: str, stops) -> str:
    """The text before the earliest stop string (the whole text when none occurs)."""
    ends = [text.find(s) for s in stops if s in text]
    return text[:min(ends)] if ends else text


def processed_greedy_decode(logits_of, prompt, max_new_tokens: int, proc: Processors, eos_ids=(),
                            decode=None) -> list[int]:
    """Target-only greedy decoding with processors and stop strings, one token at a time: the oracle.
    logits_of: token ids -> logits [T, V] of every position (no cache)."""
    new: list[int] = []
    eos = set(int(e) for e in eos_ids)
    while len(new) < max_new_tokens:
        x = process_logits(logits_of(list(prompt) + new)[-1], prompt, new, proc, eos_ids)
        token = int(np.argmax(x))
        new.append(token)
        if token in eos or (decode is not None and stop_cut(new, decode, proc.stop, len(new) - 1)):
            break
    return new
