"""Acceptance of a draft without running the target: when the target's greedy answer to a prompt is
already known (from an earlier target-only run), greedy speculative decoding is fully determined by
the draft's proposals, so the rounds it takes can be replayed with the draft alone. Used to compare
drafts cheaply (training/eval_draft.py); tests/test_acceptance.py checks it against the engine."""
from __future__ import annotations

import torch
from transformers import DynamicCache

from .compute.cache import gather_cache, rect_inputs
from .models import ModelRunner, mask_fill_value


class UnpaddedRow:
    """One unpadded row fed to a model through the engine's model call (explicit positions, a 4D
    mask, a transformers cache); `cached` tokens have K/V."""

    def __init__(self, model):
        self.runner, self.cache, self.cached = ModelRunner(model), DynamicCache(), 0
        self.fill, self.zero = mask_fill_value(torch.float32), torch.zeros(1, dtype=torch.long)

    def feed(self, tokens: list[int]) -> torch.Tensor:
        """The logits after the last of `tokens`, which are appended to the cache."""
        position, mask = rect_inputs(self.zero, self.cached, len(tokens), None, torch.float32, self.fill)
        logits = self.runner(torch.tensor([tokens]), position, mask, self.cache, last_only=True)
        self.cached += len(tokens)
        return logits[0, -1]

    def crop(self, length: int) -> None:
        """Keep the K/V of the first `length` tokens (a view)."""
        gather_cache(self.cache, None, None, length)
        self.cached = length


def simulate_rounds(draft, prompt: list[int], answer: list[int], k: int, threshold: float = 0.0,
                    floor: float | None = None) -> tuple[int, int]:
    """(tokens, rounds) of greedy speculative decoding of `prompt` when the target's greedy answer is
    known: the draft proposes from the true prefix (while its confidence is >= threshold, and the
    token it stops at if that confidence is >= floor: the proposal rule of fast.proposals without
    a cost-priced policy; floor None: threshold), leading matches are accepted, one
    target token follows; only the draft runs (batch 1, its cache cropped after each round). As in
    the engine, the first round drafts right after the prompt, and a round drafts at most
    remaining - 1 tokens."""
    from .sampling import mode_probability
    row, sequence = UnpaddedRow(draft), list(prompt) + list(answer)
    committed = rounds = 0
    while committed < len(answer):
        limit = min(k, len(answer) - committed - 1)
        proposals = []
        logits = row.feed(sequence[row.cached:len(prompt) + committed]) if limit > 0 else None
        while logits is not None and len(proposals) < limit:
            confidence = float(mode_probability(logits))
            if confidence < (threshold if floor is None else floor):
                break
            proposals.append(int(logits.argmax()))
            going_on = confidence >= threshold and len(proposals) < limit
            logits = row.feed([proposals[-1]]) if going_on else None
        accepted = 0
        while accepted < len(proposals) and proposals[accepted] == answer[committed + accepted]:
            accepted += 1
        committed += accepted + 1
        rounds += 1
        row.crop(min(row.cached, len(prompt) + committed - 1))  # K/V of rejected proposals is dropped
    return len(answer), rounds
