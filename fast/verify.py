"""One round's arithmetic on torch tensors, vectorized over rows (twin of reference.rounds)."""
from __future__ import annotations

import numpy as np
import torch


def greedy_accept(drafted: torch.Tensor, choice: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Accepted drafts per row: the agreeing prefix of drafts and target choices, at most limit (I5)."""
    k = drafted.shape[1]
    agree = (drafted == choice[:, :k]) & (torch.arange(k, device=drafted.device)[None, :] < limit[:, None])
    return agree.long().cumprod(dim=1).sum(dim=1)


def greedy_tree_path(choice: torch.Tensor, tokens: torch.Tensor, parent: torch.Tensor, size: torch.Tensor):
    """(path [R, W], accepted [R]): each row's accepted nodes in order (path[i, :accepted[i]]; -1
    after), walking from the root to the child that carries the target's choice at the current node
    while one does (reference.trees.greedy_path). choice, tokens, parent [R, W] per node; size [R]
    nodes per row, the root included. Siblings carry distinct tokens, so the child is unique."""
    rows, width = choice.shape
    real = torch.arange(width, device=choice.device)[None, :] < size[:, None]
    node = torch.zeros(rows, dtype=torch.long, device=choice.device)
    path = torch.full((rows, width), -1, dtype=torch.long, device=choice.device)
    going = torch.ones(rows, dtype=torch.bool, device=choice.device)
    for depth in range(width - 1):  # no early exit: asking the device whether any row goes on would sync
        wanted = choice.gather(1, node[:, None])  # [R, 1]: the target's token after the current node
        match = real & (parent == node[:, None]) & (tokens == wanted) & going[:, None]
        going = match.any(dim=1)
        node = torch.where(going, match.long().argmax(dim=1), node)
        path[:, depth] = torch.where(going, node, -1)
    return path, (path >= 0).sum(dim=1)


def commit_counts(choice: torch.Tensor, accepted: torch.Tensor, remaining: torch.Tensor, eos: torch.Tensor):
    """(n, hit_eos): tokens committed per row, min(accepted + 1, remaining, first new EOS + 1) (I6).

    Only this round's tokens are searched for EOS; eos is a 1-D tensor of ids (may be empty)."""
    width = choice.shape[1]
    n = torch.minimum(accepted + 1, remaining)
    is_eos = torch.isin(choice, eos) & (torch.arange(width, device=choice.device)[None, :] < n[:, None])
    first = torch.where(is_eos.any(dim=1), is_eos.long().argmax(dim=1), torch.full_like(n, width))
    hit = first < n
    return torch.where(hit, first + 1, n), hit


def committed_lists(choice: torch.Tensor, n) -> list[list[int]]:
    """Host lists of each row's committed tokens choice[i, :n[i]] (for checks and traces only)."""
    host = choice.cpu().tolist()
    return [row[:count] for row, count in zip(host, n)]


def draft_pending_after(n, accepted, k: int, pending):
    """Committed tokens without draft K/V after a round (host arrays): the draft ran on the pending
    tokens and d_1..d_{k-1}, so rows keep min(accepted, k - 1, n) of the new tokens; 1 pending
    normally, 2 after a full accept. A round without drafts (k = 0) adds its n tokens."""
    if not k:
        return pending + n
    return n - np.minimum(np.minimum(accepted, k - 1), n)
