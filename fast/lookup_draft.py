"""A training-free draft: prompt lookup / n-gram matching, shaped as a causal LM.

Its "key" for a token is the token id itself and it has no value: the engine's cache then holds each
row's history exactly like real K/V, in any layout (padded, realigned, ragged), and the 4D mask tells
the draft which slots are the row's content. For the last query of each row it finds the most recent
earlier occurrence of the row's last n tokens (n = max_ngram .. 1) in the visible history and
proposes the token that followed it; with no match it proposes the last token again. It costs a few
tensor operations per step, so it buys speed whenever a text repeats itself (summaries, code,
retrieval answers), and like any draft it cannot change the output (proofs_notes/).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from .models import WeightlessLM


class PromptLookupDraft(WeightlessLM):
    def __init__(self, vocab_size: int, max_ngram: int = 3, device="cpu", generation_config=None):
        super().__init__(vocab_size, "prompt-lookup", generation_config)
        self.max_ngram = max_ngram
        self.register_buffer("_anchor", torch.zeros(1, device=device))  # gives the module a device

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, cache=None, use_cache=True,
                logits_to_keep=0, **kwargs):
        batch, queries = input_ids.shape
        ids = input_ids.to(torch.float32)[:, None, :, None]  # [B, 1, Q, 1]: one "head", one feature
        history, _ = cache.update(ids, ids, 0)
        history = history[:, 0, :, 0].round().long()  # [B, S]
        visible = attention_mask[:, 0, -1, :] == 0  # what the last query may see: its row's content
        proposal = self._lookup(history, visible)
        keep = queries if not logits_to_keep else min(int(logits_to_keep), queries)
        logits = torch.zeros(batch, keep, self.config.vocab_size, device=input_ids.device)
        logits.scatter_(2, proposal[:, None, None].expand(batch, keep, 1), 1.0)
        return SimpleNamespace(logits=logits)

    def _lookup(self, history: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Per row: the token after the latest earlier match of its last n tokens (n from max_ngram
        down to 1), else its last token. Visible slots form a contiguous range ending at the query."""
        batch, slots = history.shape
        token = torch.where(visible, history, torch.full_like(history, -1))
        last = (visible.long() * torch.arange(slots, device=history.device)).argmax(dim=1)  # the query's slot
        proposal = token.gather(1, last[:, None])[:, 0]
        found = torch.zeros(batch, dtype=torch.bool, device=history.device)
        position = torch.arange(slots, device=history.device)[None, :]
        for n in range(self.max_ngram, 0, -1):
            match = (position < last[:, None]) & (position >= n - 1)  # j: end of an earlier n-gram
            for offset in range(n):  # token[j - offset] == token[last - offset]
                shifted = torch.roll(token, offset, dims=1)
                target = token.gather(1, (last - offset).clamp(min=0)[:, None])
                match &= (shifted == target) & (target >= 0)
            j = (match.long() * (position + 1)).argmax(dim=1)  # the latest j (0 when none)
            has = match.any(dim=1) & ~found
            follower = token.gather(1, (j + 1).clamp(max=slots - 1)[:, None])[:, 0]
            proposal = torch.where(has, follower, proposal)
            found |= has
        return proposal.clamp(min=0)  # a pad query (nothing visible) proposes token 0
