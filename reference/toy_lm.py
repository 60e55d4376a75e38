"""A small deterministic NumPy causal language model with a KV cache.

Its logits depend on the whole prefix (attention) and on absolute positions (RoPE), so any
error in padding, position ids, masks or cache slots changes its output. It is the target (and,
with `ScriptedDraft`, the draft) of the reference engine.

The forward pass is pure: it takes the K/V of the slots a query may see and returns the logits
and the K/V of the new tokens. Where those K/V are stored is the layout's business
(`reference.state`), which keeps the model and the layouts independent.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NEG = -1e30  # additive score for a masked slot (finite: a fully masked pad query stays finite)


def rope(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Rotate feature pairs of x [..., Q, D] by angles proportional to positions [..., Q]."""
    half = x.shape[-1] // 2
    freq = 1.0 / (100.0 ** (np.arange(half) / half))
    angle = positions[..., None].astype(np.float64) * freq
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


@dataclass
class ToyLM:
    """Single-head transformer: embedding, `n_layers` x (RoPE attention + tanh MLP), output head."""

    vocab_size: int = 48
    dim: int = 16
    n_layers: int = 2
    seed: int = 0
    position_scale: float = 1.0  # absolute-position signal added to the input (besides RoPE)
    weights: dict = field(init=False, repr=False)

    def __post_init__(self):
        rng = np.random.default_rng(self.seed)
        d = self.dim
        w = {"embed": rng.normal(0, 1.0, (self.vocab_size, d)), "out": rng.normal(0, 1.0, (d, self.vocab_size)),
             "pos_freq": rng.uniform(0.05, 1.5, d)}
        for layer in range(self.n_layers):
            for name in ("q", "k", "v", "o", "up", "down"):
                w[f"{name}{layer}"] = rng.normal(0, 1.5 / np.sqrt(d), (d, d))
        self.weights = w

    def forward(self, tokens, positions, past, mask):
        """One forward over new tokens.

        tokens, positions: [B, Q] ints. past: list per layer of (K, V), each [B, S, D] (S may be 0).
        mask: [B, Q, S + Q] bool, True where the query may attend (columns: past slots, then the new
        tokens in order). Returns (logits [B, Q, V], new_kv: list per layer of (K, V) [B, Q, D]).
        """
        w = self.weights
        h = w["embed"][tokens] + self.position_scale * np.sin(positions[..., None] * w["pos_freq"])
        new_kv = []
        bias = np.where(mask, 0.0, NEG)
        for layer in range(self.n_layers):
            q = rope(h @ w[f"q{layer}"], positions)
            k = rope(h @ w[f"k{layer}"], positions)
            v = h @ w[f"v{layer}"]
            new_kv.append((k, v))
            keys = np.concatenate([past[layer][0], k], axis=1)
            values = np.concatenate([past[layer][1], v], axis=1)
            scores = q @ keys.transpose(0, 2, 1) / np.sqrt(self.dim) + bias
            scores = scores - scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            h = h + (probs @ values) @ w[f"o{layer}"]
            h = h + np.tanh(h @ w[f"up{layer}"]) @ w[f"down{layer}"]
        return h @ w["out"], new_kv

    def empty_past(self, batch: int) -> list:
        empty = np.zeros((batch, 0, self.dim))
        return [(empty, empty) for _ in range(self.n_layers)]

    def logits_of(self, sequence, window: int | None = None) -> np.ndarray:
        """Logits [T, V] of an unpadded sequence computed from scratch: the batch-1 ground truth
        (window: each token sees only the last `window` tokens, itself included)."""
        logits, _ = self._from_scratch(sequence, window)
        return logits[0]

    def kv_of(self, sequence, window: int | None = None) -> list:
        """K/V [T, D] per layer of an unpadded sequence computed from scratch (for checking I3)."""
        _, kv = self._from_scratch(sequence, window)
        return [(k[0], v[0]) for k, v in kv]

    def _from_scratch(self, sequence, window):
        seq = np.asarray(sequence, dtype=np.int64)[None]
        t = np.arange(seq.shape[1])
        causal = (t[None, :] <= t[:, None]) & ((t[:, None] - t[None, :] < window) if window is not None else True)
        return self.forward(seq, t[None], self.empty_past(1), causal[None])


def greedy_decode(model: ToyLM, prompt, max_new_tokens: int, eos_ids=(), window: int | None = None) -> list[int]:
    """Plain autoregressive greedy decoding, batch 1, no padding, no cache: the oracle (I5, I6)."""
    seq = list(prompt)
    new: list[int] = []
    eos = set(int(e) for e in eos_ids)
    while len(new) < max_new_tokens:
        token = int(np.argmax(model.logits_of(seq, window)[-1]))
        seq.append(token)
        new.append(token)
        if token in eos:
            break
    return new
