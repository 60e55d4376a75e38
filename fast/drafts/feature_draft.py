"""A draft that reads the target's own features (EAGLE-style), and what the engine keeps for it.

The distilled draft of fast/distilled/smollm2-draft sees only tokens, and agrees with the target's
greedy token 53% of the time. The target's final hidden state f_j (the input of its LM head, after
its last norm) already holds what the target "thinks" at content index j; a draft that reads it needs
far less capacity to guess the next one. Here, at content index j the draft reads

    x_j = fc([embed(t_j), f_{j-1}])          (f_{-1} = 0; embed: the target's own embedding)

runs one Llama decoder layer at the target's width over x_0..x_j (causal, with a K/V cache like any
model) and a final RMS norm, and its output is its estimate f^_j of the target's feature; the draft's logits are the
target's LM head applied to f^_j, restricted to the tokens it was trained to predict
(fast.drafts.reduced_head does the same for the token draft). Drafting one token past the content uses
f^ in place of f: step s of a round reads (proposal_s, f^ of the step before).

What the engine keeps (fast.strategies.ragged): `FeatureBuffer`, each slot row's f_j for every
content index the target has processed, written by `FeatureCapture` (a forward hook on the target's
final norm) during prefills and verifies. The draft's cache holds K/V only for indices whose input
had a true feature: K/V computed from f^ are never kept, so after each round that runs the draft the
committed tokens become its pending tokens (draft_pending_after_features).

The feature head (`FeatureHeadNet`, `--draft feature:DIR` from training/train_feature_head.py) is the
same draft without attention: f^_j = norm(f_{j-1} + down(silu(fc([embed(t_j), f_{j-1}])))), one
small MLP per query and no K/V at all, so a draft step costs an MLP and the restricted head.

Exactness is untouched (proofs_notes/equivalence.md): the draft's proposals are a function of the
row's visible content (the target's features are a function of it too), and every proposal is
verified by the target.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from ..compute.lean_llama import LeanBlock, rotary_angles
from .reduced_head import SubsetLogits, restricted_head


def feature_draft_config(target_config, intermediate: int | None = None) -> LlamaConfig:
    """One decoder layer at the target's width, heads and rotary settings."""
    return LlamaConfig(
        vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size,
        intermediate_size=intermediate or target_config.intermediate_size, num_hidden_layers=1,
        num_attention_heads=target_config.num_attention_heads, num_key_value_heads=target_config.num_key_value_heads,
        head_dim=getattr(target_config, "head_dim", None), max_position_embeddings=target_config.max_position_embeddings,
        rope_parameters=getattr(target_config, "rope_parameters", None), rms_norm_eps=target_config.rms_norm_eps,
        attn_implementation="sdpa")


class FeatureDraftNet(torch.nn.Module):
    """The trained part: fc and one decoder layer (training/train_feature_draft.py trains it with
    the target's embedding and head frozen)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)  # f^ on the features' scale
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, embedded, features, position_ids):
        """Training forward over whole sequences (causal, no cache): f^ [B, T, H]."""
        x = self.fc(torch.cat([embedded, features], dim=-1))
        return self.norm(self.layer(x, position_embeddings=self.rotary(x, position_ids), position_ids=position_ids))

    def save(self, out: Path, output_tokens, log: dict) -> None:
        out.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.to(torch.float16) for k, v in self.state_dict().items() if "rotary" not in k},
                   out / "weights.pt")
        (out / "config.json").write_text(self.config.to_json_string())
        (out / "output_tokens.json").write_text(json.dumps(sorted(int(t) for t in output_tokens)) + "\n")
        (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")

    @classmethod
    def load(cls, directory) -> tuple[torch.nn.Module, list]:
        """(net, output tokens) from a trainer's output folder: a FeatureHeadNet where the config says
        feature_block "mlp" (train_feature_head.py), else a FeatureDraftNet."""
        directory = Path(directory)
        config = LlamaConfig.from_json_file(directory / "config.json")
        config._attn_implementation = "sdpa"
        net = (FeatureHeadNet if getattr(config, "feature_block", "decoder") == "mlp" else cls)(config)
        state = torch.load(directory / "weights.pt", map_location="cpu")
        missing, unexpected = net.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        if unexpected or [k for k in missing if "rotary" not in k]:
            raise ValueError(f"{directory}: feature draft weights do not match its config "
                             f"(missing {missing}, unexpected {unexpected})")
        return net, json.loads((directory / "output_tokens.json").read_text())


class FeatureHeadNet(torch.nn.Module):
    """The feature head: f^_j = norm(f_{j-1} + down(silu(fc([embed(t_j), f_{j-1}])))), position by
    position (no attention, no cache). config: feature_head_config (num_hidden_layers 0, so a lookup
    in front keeps its token history in cache layer 0)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.fc = torch.nn.Linear(2 * config.hidden_size, config.intermediate_size, bias=False)
        self.down = torch.nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, embedded, features, position_ids=None):
        """f^ [..., H] for embedded and features [..., H] (position_ids unused: kept for the trainers)."""
        inner = F.silu(self.fc(torch.cat([embedded, features], dim=-1)))
        return self.norm(features + self.down(inner))

    save = FeatureDraftNet.save


def feature_head_config(target_config, intermediate: int) -> LlamaConfig:
    """The feature head's config: the target's width, an MLP of `intermediate`, no decoder layer."""
    return LlamaConfig(vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size,
                       intermediate_size=intermediate, num_hidden_layers=0, rms_norm_eps=target_config.rms_norm_eps,
                       num_attention_heads=target_config.num_attention_heads, feature_block="mlp")


load_feature_net = FeatureDraftNet.load  # either kind of feature draft, by its config


def final_norm(target):
    """The target's final norm module, whose output is the feature the draft reads."""
    base = getattr(target, "model", None)
    norm = getattr(base, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise ValueError(f"a feature draft needs a target with a final norm at .model.norm (Llama-style); "
                         f"{type(target).__name__} has none")
    return norm


class FeatureDraft(torch.nn.Module):
    """The engine's draft: `net` on the `target`'s embedding, with the target's LM head restricted to
    `token_ids`. forward(input_ids, position_ids, attention_mask, cache, features) -> logits [B, Q, V]
    (or the last query's) and `.features`, f^ [B, Q, H] of every query (the feature head: of the kept
    queries only, since its queries do not depend on each other); features[b, q] must be f_{j-1} for
    the token at content index j (zero at j = 0). subset_logits=True: the logits as
    fast.drafts.reduced_head.SubsetLogits."""

    reads_features = True
    returns_subset = True  # forward(subset_logits=True) is understood

    def __init__(self, target, net, token_ids):
        super().__init__()
        if net.config.hidden_size != target.config.hidden_size:
            raise ValueError(f"feature draft has width {net.config.hidden_size} but the target has "
                             f"{target.config.hidden_size}; it was trained for another target")
        final_norm(target)
        self.config = net.config
        self.generation_config = target.generation_config
        dtype, device = target.get_input_embeddings().weight.dtype, target.device
        net = net.to(dtype=dtype, device=device)
        self.embed = target.get_input_embeddings()  # shared with the target, not copied
        self.fc = net.fc
        self.mlp = isinstance(net, FeatureHeadNet)  # the feature head: no decoder layer, no K/V
        self.down = net.down if self.mlp else None
        self.block = None if self.mlp else LeanBlock(net.layer, net.config)
        self.norm, self.eps = net.norm.weight, net.config.rms_norm_eps
        self.rotary = None if self.mlp else net.rotary
        head = target.get_output_embeddings()
        self.head, ids = restricted_head(head, token_ids)  # the target's head over the trained tokens
        self.register_buffer("token_ids", ids, persistent=False)
        self.vocab_size = head.weight.shape[0]

    @property
    def device(self):
        return self.head.weight.device

    def get_output_embeddings(self):
        return SimpleNamespace(weight=torch.empty(self.vocab_size, 0))  # its vocabulary: the target's

    @property
    def computes_row_subset(self) -> bool:
        """Whether forward(rows=...) is understood: the feature head's rows are independent and it
        keeps no K/V, so rows it does not compute leave nothing stale behind."""
        return self.mlp

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, cache=None, features=None,
                logits_to_keep=0, subset_logits=False, rows=None, **kwargs):
        """rows (the feature head only): a tensor of batch rows to compute; every other row's outputs
        are placeholders (logits 0 over the trained tokens, features 0) that the caller never reads
        (fast.engine.draft_round: rows that no longer draft this round)."""
        if features is None:
            raise ValueError("a feature draft needs the target's features for its inputs (the ragged strategy "
                             "passes them)")
        features = features.to(self.head.weight.dtype)
        if self.mlp and logits_to_keep:  # every index stands alone: compute the kept queries only
            input_ids, features = input_ids[:, -int(logits_to_keep):], features[:, -int(logits_to_keep):]
        if rows is not None and not self.mlp:
            raise ValueError("only the feature head computes a subset of rows (a decoder layer keeps K/V)")
        batch = input_ids.shape[0]
        if rows is not None:
            input_ids, features = input_ids[rows], features[rows]
        x = self.fc(torch.cat([self.embed(input_ids), features], dim=-1))
        if self.mlp:
            predicted = features + self.down(F.silu(x))
        else:
            cos, signed_sin = rotary_angles(self.rotary, x, position_ids)
            predicted = self.block(x, cos, signed_sin, attention_mask, cache, 0)
        predicted = F.rms_norm(predicted, (predicted.shape[-1],), self.norm, self.eps)
        hidden = predicted[:, -int(logits_to_keep):] if logits_to_keep else predicted
        values = self.head(hidden)
        if rows is not None:  # back to the whole batch: the rows not computed hold zeros
            values = values.new_zeros((batch,) + values.shape[1:]).index_copy_(0, rows, values)
            predicted = predicted.new_zeros((batch,) + predicted.shape[1:]).index_copy_(0, rows, predicted)
        logits = SubsetLogits(values, self.token_ids, self.vocab_size)
        return SimpleNamespace(logits=logits if subset_logits else logits.full(), features=predicted)


class FeatureBuffer:
    """features[slot row, content index]: the target's feature f_j of each processed token."""

    def __init__(self, slots: int, capacity: int, hidden: int, dtype, device):
        self.data = torch.zeros(slots, capacity + 1, hidden, dtype=dtype, device=device)

    def write(self, rows: torch.Tensor, index: torch.Tensor, hidden: torch.Tensor) -> None:
        """rows, index [...] and hidden [..., H]: f at (row, index); negative indices are skipped."""
        keep = index >= 0
        self.data[rows[keep], index[keep]] = hidden[keep].to(self.data.dtype)

    def inputs(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The draft's feature input for the tokens at (row, index): f_{index - 1}, zero at index <= 0."""
        before = self.data[rows, (index - 1).clamp(min=0)]
        return torch.where((index > 0)[..., None], before, torch.zeros_like(before))

    def move_row(self, src: int, dst: int, count: int) -> None:
        self.data[dst, :count] = self.data[src, :count]

    @property
    def capacity(self) -> int:
        """The content indices it holds, the spare last one not counted (a tree move's trash slot)."""
        return self.data.shape[1] - 1

    def keep_path(self, rows: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> None:
        """A tree round's accepted path (fast.trees): row rows[m]'s features at source[m, j] move to
        target[m, j], every source read before anything is written."""
        moved = self.data[rows[:, None], source]
        self.data[rows[:, None], target] = moved


class FeatureCapture:
    """A forward hook on the target's final norm that writes each forward's features into a
    FeatureBuffer: `route(rows, index)` before a forward names each token position's slot row and
    content index (tensors shaped like the forward's input ids); a forward not routed writes nothing."""

    def __init__(self, target, buffer: FeatureBuffer):
        self.buffer, self.where = buffer, None
        self.handle = final_norm(target).register_forward_hook(self._hook)

    def route(self, rows: torch.Tensor, index: torch.Tensor) -> dict:
        self.where = (rows, index)
        return {}

    def _hook(self, module, args, output):
        if self.where is not None:
            rows, index = self.where
            self.buffer.write(rows, index, output.detach())
            self.where = None

    def close(self) -> None:
        self.handle.remove()


def draft_pending_after_features(n: np.ndarray, model_steps: int, pending: np.ndarray) -> np.ndarray:
    """Committed tokens whose draft K/V are not (validly) cached after a round: a round that ran the
    draft cached its pending tokens with true features and everything after them with f^, so the n
    tokens just committed are pending; a round without draft steps adds its n to what was pending."""
    return n.copy() if model_steps else pending + n
