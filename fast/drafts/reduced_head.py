"""A draft whose output head covers only the tokens it was trained to predict.

The distilled SmolLM2 draft is 14.7M parameters, 12.6M of them the 49,152 x 256 output head, and a
draft step on the CPU is mostly that head. It was trained over a subset of the vocabulary (the
tokens the target's answers use), so its logits outside that set carry nothing learned. Here the
head multiplies only the rows of those tokens and every other logit is a very negative constant:
the draft proposes within the set, its confidence (fast.proposals) and its distribution are the
model's over the set. Any draft keeps output equivalence (proofs_notes/equivalence.md: drafts are
functions of the visible content), so this changes speed and acceptance, never outputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..compute.lean_llama import LeanLlama, linear_from, supported
from ..models import cache_argument


def restricted_head(head: torch.nn.Linear, token_ids) -> tuple[torch.nn.Linear, torch.Tensor]:
    """(a copy of `head` with only the rows of `token_ids`, those ids sorted as a tensor)."""
    ids = torch.as_tensor(sorted(set(int(t) for t in token_ids)), dtype=torch.long, device=head.weight.device)
    with torch.no_grad():
        return linear_from(head.weight[ids], None if head.bias is None else head.bias[ids]), ids


def full_vocab_logits(small: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over the whole vocabulary from a restricted head's [..., len(token_ids)]: the others get a
    very negative constant (never proposed)."""
    logits = small.new_full(small.shape[:-1] + (vocab_size,), torch.finfo(small.dtype).min / 2)
    return logits.index_copy_(-1, token_ids, small)


@dataclass
class SubsetLogits:
    """A restricted head's logits kept as they are: values [..., n] over `token_ids` (sorted), every
    other token of the `vocab`-token vocabulary very negative. A greedy draft step reads its proposal
    and confidence from the n values (fast.sampling.Greedy.draft: at batch 13 a [13, 49,152] argmax
    and softmax cost ~2.5 ms of a ~12 ms step); `full()` builds the whole vocabulary's logits for
    anything else. Indexing (`logits[:, -1]`) selects queries, never the vocabulary axis."""

    values: torch.Tensor
    token_ids: torch.Tensor
    vocab: int

    def __getitem__(self, index) -> "SubsetLogits":
        return SubsetLogits(self.values[index], self.token_ids, self.vocab)

    def full(self) -> torch.Tensor:
        return full_vocab_logits(self.values, self.token_ids, self.vocab)


def full_logits(logits) -> torch.Tensor:
    """Logits over the whole vocabulary, from a tensor (as it is) or SubsetLogits."""
    return logits.full() if isinstance(logits, SubsetLogits) else logits


class ReducedHeadDraft(torch.nn.Module):
    """`model` (a Hugging Face causal LM) with its output head restricted to `token_ids`.

    feature_projection: an optional [hidden, target hidden] weight. The draft then also reads the
    target's features (fast.drafts.feature_draft): at content index j its input embedding is
    embed(t_j) + P f_{j-1}; forward(features=None), past the content where the target has not yet
    seen the tokens, reads zero (training/train_conditioned_draft.py trains it so).
    forward(subset_logits=True) returns SubsetLogits instead of the whole vocabulary's logits."""

    returns_subset = True

    def __init__(self, model, token_ids, feature_projection=None):
        super().__init__()
        self.model = model
        self.cache_kw = cache_argument(model)
        head = model.get_output_embeddings()
        self.head, ids = restricted_head(head, token_ids)
        self.register_buffer("token_ids", ids, persistent=False)
        self.lean = LeanLlama(model) if supported(model) else None  # fewer, fused operations per step
        self.vocab_size = head.weight.shape[0]
        self.projection = None if feature_projection is None else linear_from(
            torch.as_tensor(feature_projection).to(device=head.weight.device, dtype=head.weight.dtype))
        self.reads_features = self.projection is not None
        self.config = model.config
        self.generation_config = model.generation_config

    @property
    def device(self):
        return self.model.device

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()  # the full vocabulary: what the target is checked against

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, cache=None, use_cache=True,
                logits_to_keep=0, features=None, subset_logits=False, **kwargs):
        added = None
        if self.projection is not None and features is not None:
            added = self.projection(features.to(self.projection.weight.dtype))
        if self.lean is not None:
            hidden = self.lean(input_ids, position_ids, attention_mask, cache, added)
        else:
            inputs = {"input_ids": input_ids} if added is None else \
                {"inputs_embeds": self.model.get_input_embeddings()(input_ids) + added}
            hidden = self.model.base_model(**inputs, position_ids=position_ids, attention_mask=attention_mask,
                                           use_cache=True, **{self.cache_kw: cache}).last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -int(logits_to_keep):]
        logits = SubsetLogits(self.head(hidden), self.token_ids, self.vocab_size)
        features = None  # no estimates of the target's features
        return SimpleNamespace(logits=logits if subset_logits else logits.full(), features=features)
