"""Counter-based randomness keyed by (seed, request id, absolute position, purpose).

No generator state: the same key always gives the same numbers, whatever the batch, slot, round or
strategy, so scheduling cannot change sampled outputs (S4). The hash works in 31-bit arithmetic on
int64 tensors (products stay below 2^62: no overflow on any device); two independent 31-bit hashes
make one uniform with 62 random bits.
"""
from __future__ import annotations

import torch

PRIME = 2_147_483_647  # 2^31 - 1
PURPOSES = {"draft": 1, "accept": 2, "sample": 3, "gumbel": 4,
            "sibling": 5, "accept-sibling": 6}  # a token tree's extra candidates (fast.trees), keyed by their number
_MULTIPLIERS = (1_103_515_245 % PRIME, 69_069, 1_664_525, 22_695_477, 1_566_083_941 % PRIME)


def _mix(h: torch.Tensor, x: torch.Tensor, round_: int) -> torch.Tensor:
    h = (h * _MULTIPLIERS[round_ % len(_MULTIPLIERS)] + (x % PRIME) + round_ + 1) % PRIME
    return (h ^ (h >> 13)) % PRIME


def _hash(parts, salt: int) -> torch.Tensor:
    h = torch.full_like(parts[0], 12345 + salt)
    for i, x in enumerate(parts):
        h = _mix(h, x, i + salt)
    for i in range(3):  # avalanche
        h = _mix(h, h >> 7, i + 11 + salt)
    return h


def uniform(seed: torch.Tensor, request: torch.Tensor, position: torch.Tensor, purpose: str,
            index: torch.Tensor | None = None) -> torch.Tensor:
    """Uniform(0, 1) float64 per broadcast key; `index` adds a last key (e.g. the vocabulary entry)."""
    parts = [seed.long(), request.long(), position.long(), torch.full_like(position.long(), PURPOSES[purpose])]
    if index is not None:
        shape = torch.broadcast_shapes(*(p.shape for p in parts), index.shape)
        parts = [p.expand(shape) for p in parts] + [index.long().expand(shape)]
    else:
        shape = torch.broadcast_shapes(*(p.shape for p in parts))
        parts = [p.expand(shape) for p in parts]
    high, low = _hash(parts, 0).double(), _hash(parts, 100).double()
    return (high * PRIME + low + 0.5) / (float(PRIME) * PRIME)


def gumbel(seed, request, position, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [..., vocab] for the coupled mode, keyed per vocabulary entry."""
    index = torch.arange(vocab, device=position.device)
    u = uniform(seed[..., None], request[..., None], position[..., None], "gumbel", index)
    return -torch.log(-torch.log(u))
