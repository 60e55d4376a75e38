"""Tensor parallelism: one target sharded over the ranks of a group, by transformers' own plan.

Under torchrun with `--tensor-parallel T`, the WORLD_SIZE ranks form WORLD_SIZE / T groups of T
consecutive ranks (a (dp, tp) device mesh). Each group holds one copy of the target, sharded by the
model's `tp_plan` (transformers.distributed.tensor_parallel: attention heads and MLP columns split,
an all-reduce after each row-wise product); the draft is replicated on every rank. Every rank of a
group runs the same requests and the same rounds, so the all-reduces pair up; the groups split the
requests between them as data-parallel ranks do (specbatch.distributed).

What keeps the ranks of a group in step: every input to a round is the same on each of them
(prompts, the draft's tokens, sampling randomness keyed by request and position, the target's
reduced logits), except the clock. The goodput policy prices proposals from measured seconds, so
those are agreed: each group takes its first rank's measurements (`clock_agreement`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import SpecbatchError


class TensorParallelError(SpecbatchError, ValueError):
    """A model or a launch that tensor parallelism cannot serve; the message names the reason."""


@dataclass(frozen=True)
class Parallel:
    """Where this process sits: rank of world ranks, in groups of `tp` consecutive ranks."""

    rank: int = 0
    world: int = 1
    tp: int = 1
    mesh: object = None  # the 1-D tensor-parallel DeviceMesh of this rank's group (None when tp == 1)

    @property
    def dp_rank(self) -> int:  # which group: the data-parallel shard of the requests
        return self.rank // self.tp

    @property
    def dp_size(self) -> int:
        return self.world // self.tp

    @property
    def tp_rank(self) -> int:  # rank within the group
        return self.rank % self.tp

    @property
    def writes(self) -> bool:
        """Whether this rank writes its group's results (the group's first rank)."""
        return self.tp_rank == 0


def layout(rank: int, world: int, tp: int, device_type: str = "cpu") -> Parallel:
    """The Parallel of this rank; builds the (dp, tp) mesh when tp > 1 (the process group must be up)."""
    if world < tp:
        raise TensorParallelError(f"--tensor-parallel {tp} shards the target over {tp} processes, but {world} "
                                  f"{'is' if world == 1 else 'are'} running: launch with torchrun "
                                  f"--nproc-per-node {tp} (or a multiple of {tp})")
    if tp < 1 or world % tp:
        raise TensorParallelError(f"--tensor-parallel {tp} does not divide the {world} processes launched "
                                  f"(torchrun --nproc-per-node): use a divisor of {world}")
    if tp == 1:
        return Parallel(rank, world, 1)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return Parallel(rank, world, tp, mesh["tp"])


def check_shardable(model, tp: int) -> dict:
    """The model's tensor-parallel plan, expanded to module names; TensorParallelError when it has
    none or its heads do not divide among `tp` ranks."""
    name = type(model).__name__
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan or not hasattr(model, "_expand_parallel_plan"):
        raise TensorParallelError(f"the target ({name}) has no tensor-parallel plan in transformers; run it "
                                  "without --tensor-parallel")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if heads is not None and heads % tp:
            raise TensorParallelError(f"the target's {heads} {field.replace('num_', '').replace('_', ' ')} do "
                                      f"not divide among {tp} ranks; use a --tensor-parallel that divides {heads}")
    return model._expand_parallel_plan(plan)


def shard(model, parallel: Parallel):
    """Shard `model` (loaded whole on this rank) over the rank's group by its own plan: every rank
    keeps its slice of each planned weight as a DTensor, and the planned layers reduce their outputs."""
    if parallel.tp == 1:
        return model
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    plan = check_shardable(model, parallel.tp)
    # A tied weight (the output head sharing the input embedding) is one Parameter under two names:
    # the plan shards it under the first name, and the other name is pointed at that shard after.
    first = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    apply_tensor_parallelism(model, parallel.mesh, {k: v for k, v in plan.items() if k not in aliases})
    for alias, name in aliases.items():
        owner, _, param = alias.rpartition(".")
        model.get_submodule(owner)._parameters[param] = model.get_parameter(name)
    return model


def mesh_of(model):
    """The device mesh `model`'s weights are sharded over, or None for a model held whole."""
    if not isinstance(model, torch.nn.Module):
        return None
    from torch.distributed.tensor import DTensor
    return next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)  # one pass


def clock_agreement(model):
    """agree(*seconds) -> the first rank's seconds on every rank of the group `model` is sharded
    over (fast.engine.Clock), or None for a model held whole."""
    mesh = mesh_of(model)
    if mesh is None:
        return None
    group = mesh.get_group()
    first = dist.get_global_rank(group, 0)

    def agree(*seconds: float) -> tuple[float, ...]:
        shared = torch.tensor(seconds, dtype=torch.float64)
        dist.broadcast(shared, src=first, group=group)
        return tuple(shared.tolist())
    return agree
