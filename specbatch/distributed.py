"""Data-parallel generation on torch.distributed (torchrun, or any launcher that sets RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT).

Each rank takes the requests whose index i satisfies i % world_size == rank, runs the chosen
strategy on its own device, and the results are gathered in input order. Randomness is keyed by
the global request id (seed, request, position), so outputs are identical to a single-process run
for greedy decoding and for both sampling modes.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .fast.engine import GenerationResult


def world() -> tuple[int, int]:
    """(rank, world size): from torch.distributed when initialised, else the launcher's environment."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_from_env(device: str = "cpu") -> tuple[int, int]:
    """Join the process group the launcher describes (gloo on CPU, nccl on CUDA); one CPU thread share
    per local process so that ranks on one machine do not oversubscribe its cores."""
    rank, size = world()
    if size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if str(device).startswith("cuda") else "gloo")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        if not str(device).startswith("cuda"):
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return world()


def shutdown() -> None:
    """Leave the process group: every rank waits for the others, then the group is destroyed.

    Without it the gloo group is torn down by the interpreter's exit while its worker threads are
    still joinable, and a rank can die at exit with "terminate called without an active exception"
    (SIGABRT), which torchrun reports as a failure although every result was written."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def shard(count: int, rank: int, size: int) -> list[int]:
    """The request indices this rank decodes: a deterministic round-robin shard."""
    return list(range(rank, count, size))


def local_device(device: str) -> str:
    """cuda -> cuda:LOCAL_RANK under a launcher; anything else unchanged."""
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        return f"cuda:{os.environ['LOCAL_RANK']}"
    return device


def gather(obj):
    """All ranks' objects, in rank order (the object itself when not distributed)."""
    rank, size = world()
    if size == 1 or not dist.is_initialized():
        return [obj]
    out = [None] * size
    dist.all_gather_object(out, obj)
    return out


def generate(target, draft, prompts, *, max_new_tokens, seed=0, **kwargs) -> GenerationResult:
    """`specbatch.generate` over all ranks: same arguments, same results (input order) on every rank.
    A target sharded by specbatch.tensor_parallel.shard is run by each group of ranks that holds it,
    the groups splitting the requests.

    stats are this rank's own (throughput of its shard); sequences, stop_reasons and
    request_stats cover every request."""
    import specbatch
    from .tensor_parallel import Parallel, mesh_of
    rank, size = init_from_env(str(next(target.parameters()).device))
    mesh = mesh_of(target)  # a sharded target: its group's ranks run the same requests
    group = Parallel(rank, size, mesh.size() if mesh is not None else 1)
    mine = shard(len(prompts), group.dp_rank, group.dp_size)
    pick = lambda values: [values[i] for i in mine] if isinstance(values, (list, tuple)) else values  # noqa: E731
    local = specbatch.generate(target, draft, [prompts[i] for i in mine], max_new_tokens=pick(max_new_tokens),
                               seed=pick(seed), request_ids=mine, **kwargs) if mine else None
    parts = gather((mine, local.sequences if local else [], local.stop_reasons if local else [],
                    local.request_stats if local else []))
    sequences, reasons, stats = [None] * len(prompts), [None] * len(prompts), [None] * len(prompts)
    for indices, seqs, why, per in parts:
        for j, i in enumerate(indices):
            sequences[i], reasons[i], stats[i] = seqs[j], why[j], per[j]
    return GenerationResult(sequences, reasons, local.stats if local else {}, None, stats)
