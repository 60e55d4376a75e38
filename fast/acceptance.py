"""Acceptance of a draft without running the target: when the target's greedy answer to a prompt is
already known (from an earlier target-only run), greedy speculative decoding is fully determined by
the draft's proposals, so the rounds it takes can be replayed with the draft alone. Used to compare
drafts cheaply (training/eval_draft.py); tests/test_acceptance.py checks it against the engine."""
from __future__ import annotations

import torch
from transformers import DynamicCache

from .cache import cache_layers, rect_inputs
from .models import ModelRunner, mask_fill_value


def simulate_rounds(draft, prompt: list[int], answer: list[int], k: int) -> tuple[int, int]:
    """(tokens, rounds) of greedy speculative decoding of `prompt` when the target's greedy answer is
    known: the draft proposes from the true prefix, leading matches are accepted, one target token
    follows; only the draft runs (batch 1, its cache cropped after each round). As in the engine, the
    first round drafts right after the prompt, and a round drafts at most remaining - 1 tokens."""
    runner, cache = ModelRunner(draft), DynamicCache()
    sequence, cached, committed, rounds = list(prompt) + list(answer), 0, 0, 0
    fill = mask_fill_value(torch.float32)
    zero = torch.zeros(1, dtype=torch.long)

    def feed(tokens: list[int]) -> int:
        nonlocal cached
        position, mask = rect_inputs(zero, cached, len(tokens), None, torch.float32, fill)
        logits = runner(torch.tensor([tokens]), position, mask, cache, last_only=True)
        cached += len(tokens)
        return int(logits[0, -1].argmax())

    while committed < len(answer):
        content = len(prompt) + committed
        limit = min(k, len(answer) - committed - 1)
        proposals = []
        if limit > 0:
            proposals.append(feed(sequence[cached:content]))
            while len(proposals) < limit:
                proposals.append(feed([proposals[-1]]))
        accepted = 0
        while accepted < len(proposals) and proposals[accepted] == answer[committed + accepted]:
            accepted += 1
        committed += accepted + 1
        rounds += 1
        keep = min(cached, len(prompt) + committed - 1)  # K/V of rejected proposals is dropped
        for layer in cache_layers(cache):
            layer.keys, layer.values = layer.keys[..., :keep, :], layer.values[..., :keep, :]
        cached = keep
    return len(answer), rounds
