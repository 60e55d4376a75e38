"""The speed choices that depend on the device, made in one place.

No choice here changes what is computed, only how fast: target-only and speculative decoding run
through the same choices, and I1-I7 hold under each (tests/test_backend.py runs the engine under both
sets against transformers). `for_device(device)` picks them by the device's type:

| choice | CPU | CUDA (and any other accelerator) |
|---|---|---|
| `prepack_linears`: oneDNN prepacked weights (fast.compute.kernels; row counts padded where measured cheaper, fast.compute.row_plan) | on | off |
| `wide_half_kv`: float32 K/V for bfloat16/float16 models | on: the small attention products run several times faster in float32 | off: the model's dtype, half the memory traffic |
| `grouped_attention`: rows grouped by visible length, each group read by the kernel measured faster, at the measured price of a group (fast.compute.attention, fast.compute.attention_cost) | on: reading slots is the cost, a Python loop over groups is cheap beside a 100 ms step | off: one fused SDPA call over every row of the ragged layout, since a launch per group costs more than the slots it saves |

A model sharded by tensor parallelism (specbatch.tensor_parallel: DTensor weights) keeps
transformers' own sharded layers: the paths that replace a layer's forward or read its weights
directly (prepacked linears, compiled blocks, the lean Llama draft forward) take only the models
`held_whole` returns, and the engine's attention and caches work on each rank's share of the heads.

SPECBATCH_BACKEND=cpu or =cuda runs one device type's choices on any device: the tests run the CUDA
choices on the CPU this way, so that the fused attention path is checked where no GPU is.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

@dataclass(frozen=True)
class Backend:
    name: str  # whose choices these are: "cpu" or "cuda"
    prepack_linears: bool
    wide_half_kv: bool
    grouped_attention: bool


CHOICES = {
    "cpu": Backend("cpu", prepack_linears=True, wide_half_kv=True, grouped_attention=True),
    "cuda": Backend("cuda", prepack_linears=False, wide_half_kv=False, grouped_attention=False),
}


def for_device(device) -> Backend:
    """The choices for `device` (a torch.device or its name); SPECBATCH_BACKEND overrides them."""
    forced = os.environ.get("SPECBATCH_BACKEND", "").strip().lower()
    if forced:
        if forced not in CHOICES:
            raise ValueError(f"SPECBATCH_BACKEND={forced!r} is not one of {', '.join(CHOICES)}")
        return CHOICES[forced]
    return CHOICES["cpu" if torch.device(device).type == "cpu" else "cuda"]


def sharded(model) -> bool:
    """Whether any weight of `model` is a tensor-parallel shard (a DTensor)."""
    if not isinstance(model, torch.nn.Module):
        return False
    from torch.distributed.tensor import DTensor
    return any(isinstance(p, DTensor) for p in model.parameters())


def held_whole(*models) -> list:
    """The models (None skipped) that the CPU speed paths may rewrite: those not sharded."""
    return [m for m in models if m is not None and not sharded(m)]
