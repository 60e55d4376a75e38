"""A scripted draft for Hugging Face models: follow a base model, deviate where a rule says.

`ScriptedDraft(target, rule)` proposes the target's own greedy continuation except where
`rule(next_index, token)` fires (the rules of specbatch.reference.drafts, e.g. `deviate_at` or
`deviate_hashed`), so any acceptance pattern can be produced on purpose, with real caches.
`ImposedLM(table)` is a "model" whose next-token distribution is given outright, for the exact
distribution tests of sampling (tests/test_sampling.py, benchmarks/acceptance_modes.py).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from ...reference.drafts import DeviateRule
from ..models import WeightlessLM, cache_argument

# Two imposed distributions over 3 tokens, table[position, previous token] (positions past 2 reuse 2)
IMPOSED_P = np.array([[[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]],
                      [[0.1, 0.7, 0.2], [0.5, 0.1, 0.4], [0.25, 0.25, 0.5]],
                      [[0.4, 0.4, 0.2], [0.2, 0.2, 0.6], [0.7, 0.2, 0.1]]])
IMPOSED_Q = np.array([[[0.1, 0.2, 0.7], [0.6, 0.2, 0.2], [0.3, 0.6, 0.1]],
                      [[0.5, 0.1, 0.4], [0.2, 0.2, 0.6], [0.6, 0.3, 0.1]],
                      [[0.1, 0.1, 0.8], [0.5, 0.4, 0.1], [0.2, 0.6, 0.2]]])


class ImposedLM(WeightlessLM):
    """A "model" whose next-token distribution is table[position, previous token]; it keeps a dummy
    cache entry per token so the engine's cache bookkeeping runs as for a real model. It attends to
    nothing, so any verify layout (a token tree's included) gives each query its own distribution."""

    attends = False

    def __init__(self, table):
        table = np.asarray(table)
        super().__init__(table.shape[-1], "imposed")
        self.register_buffer("log_table", torch.tensor(table).log())

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, cache=None, logits_to_keep=0, **kw):
        dummy = torch.zeros(input_ids.shape[0], 1, input_ids.shape[1], 1, dtype=torch.float64)
        cache.update(dummy, dummy, 0)
        logits = self.log_table[position_ids.clamp(max=self.log_table.shape[0] - 1), input_ids]
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def confident_logits(logits: torch.Tensor, confidence: torch.Tensor) -> torch.Tensor:
    """Logits with the same argmax whose softmax gives that token probability `confidence` [..]
    (at least 1/V) and spreads the rest evenly: scripted confidences for the proposal rule."""
    vocab = logits.shape[-1]
    c = confidence.to(torch.float64).clamp(min=1.0 / vocab, max=1 - 1e-9)
    rest = torch.log((1 - c) / (vocab - 1))
    out = rest[..., None].expand(logits.shape).clone()
    out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), torch.log(c)[..., None])
    return out.to(logits.dtype)


def _demote_top(logits: torch.Tensor, fire: torch.Tensor, swap: bool) -> torch.Tensor:
    """logits with, where fire [..., 1], the best token pushed to the bottom or (swap) traded with the second."""
    logits = logits.clone()
    if swap:
        best = logits.topk(2, dim=-1)
        top, second = best.indices[..., :1], best.indices[..., 1:]
        logits.scatter_(-1, top, torch.where(fire, best.values[..., 1:], best.values[..., :1]))
        logits.scatter_(-1, second, torch.where(fire, best.values[..., :1], best.values[..., 1:]))
    else:
        top = logits.argmax(dim=-1, keepdim=True)
        logits.scatter_(-1, top, torch.where(fire, torch.finfo(logits.dtype).min, logits.gather(-1, top)))
    return logits


class ScriptedDraft(torch.nn.Module):
    """confidence: optional rule(next_index, token) -> probability in [0, 1] of the proposal; the
    draft's distribution then has exactly that top probability (fast.proposals stops a row below
    its threshold), so proposal lengths can be scripted too. Where the rule fires, base's best token
    drops to the bottom, or with swap=True trades places with the second best (the draft's second
    guess is then base's first: what a token tree's leaves catch; reference.drafts.ScriptedDraft)."""

    def __init__(self, base, rule: DeviateRule, confidence=None, swap: bool = False):
        super().__init__()
        self.base, self.rule, self.confidence, self.swap = base, rule, confidence, swap
        self._cache_kw = cache_argument(base)

    @property
    def config(self):
        return self.base.config

    @property
    def device(self):
        return self.base.device

    @property
    def generation_config(self):
        return self.base.generation_config

    def get_output_embeddings(self):
        return self.base.get_output_embeddings()

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, cache=None, use_cache=True,
                logits_to_keep=0, **kwargs):
        out = self.base(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                        use_cache=use_cache, logits_to_keep=logits_to_keep, **{self._cache_kw: cache}, **kwargs)
        logits = out.logits
        q = logits.shape[1]
        fire = self.rule((position_ids[:, -q:] + 1).cpu().numpy(), input_ids[:, -q:].cpu().numpy())
        fire = torch.as_tensor(fire, device=logits.device)
        if fire.any():
            logits = _demote_top(logits, fire[..., None], self.swap)
        if self.confidence is not None:
            c = self.confidence((position_ids[:, -q:] + 1).cpu().numpy(), input_ids[:, -q:].cpu().numpy())
            logits = confident_logits(logits, torch.as_tensor(c, device=logits.device))
        out.logits = logits
        return out
