"""Sibling-leaf token trees in the ragged engine (tree_branches > 1; reference.trees is the specification).

A row's tree is its chain of proposals (the spine: node j, 1 <= j <= p, carries d_j under node j - 1)
plus, under each spine node j - 1 < p, up to b - 1 leaves: the other candidates for position
c - 1 + j should d_j miss. In greedy and coupled mode they are the draft's next most likely tokens
at that step; in rejection mode, further independent draws from the step's q (fast.sampling, the
chooser's `siblings`). A lookup row (its proposals came from prompt lookup,
fast.drafts.lookup_draft) takes the tokens that followed the other occurrences of its matched
n-gram (`other_followers`), in greedy and coupled mode only: its q is one-hot, so in rejection mode
it has no draws to offer and its tree is its chain. How many leaves a step brings is the proposal
rule's (fast.proposals: the goodput rule takes those whose expected worth pays for their verify
token, so a row's tree may be its chain; the threshold rule every candidate). Spine nodes are
numbered first, so a tree's first p + 1 nodes are the row's chain (fast.layout.VerifyLayout); the
leaves follow, step by step.

One verify forward computes every node's target logits (fast.layout.TreeLayout, tree masks from
parents and lengths, never from token ids). Greedy and coupled: the walk (fast.verify.greedy_tree_path,
`verify_tree`) accepts the longest path whose tokens are the target's choices, and the row commits
the choices along root + path. Rejection: `rejection_walk` tests each node's candidates in turn.
Either way the path's K/V move from scratch slots to content slots (SlotCache.keep_path, I3), and
so do a feature draft's target features (fast.drafts.feature_draft: every node's are captured at
its scratch slot). The draft's own cache holds K/V of the spine only, so the proposer is told how
many leading path nodes are spine nodes (`spine_accepted`; proofs_notes/trees.md, Lemma T4).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import rng
from .layout import TreeLayout
from .sampling import residual_distribution, sample_from
from .verify import greedy_tree_path


@dataclass(frozen=True)
class SiblingTrees:
    """One round's trees over the rows: the layout and, per node, where its token is found in the
    round's candidate matrix [R, 1 + P * b] = (pending token, d_1..d_P, step 0's b - 1 siblings,
    step 1's, ...), P the longest proposal. Step j's proposal brings the leading leaves[i, j] of its
    siblings (the proposal rule's, fast.proposals; at most b - 1), numbered after the spine, step by
    step: leaf r of step j is node leaf_start[i, j] + r."""

    layout: TreeLayout
    parents: list  # per row, its nodes' parents (np arrays)
    source: np.ndarray  # [R, W] column of node j of row i in the candidate matrix (clamped past its last)
    longest: int  # P
    proposed: np.ndarray  # [R] spine nodes per row, p_i
    branches: int  # b: the most candidates per spine step (the proposal and b - 1 leaves)
    leaves: np.ndarray  # [R, P] leaves under each spine step (0 past p_i)
    leaf_start: np.ndarray  # [R, P] the node number of each step's first leaf

    @classmethod
    def of(cls, proposed, branches: int, content, leaves=None) -> "SiblingTrees":
        """leaves [R, >= P]: per row and step, as the proposal rule chose them (None: b - 1 under every
        proposal)."""
        proposed = np.asarray(proposed, dtype=np.int64)
        longest = int(proposed.max(initial=0))
        step = np.arange(longest)[None, :]
        most = branches - 1 if leaves is None else np.asarray(leaves, dtype=np.int64)[:, :longest]
        leaves = np.where(step < proposed[:, None], most, 0)
        before = np.cumsum(leaves, axis=1) - leaves  # leaves of the earlier steps
        leaf_start = proposed[:, None] + 1 + before
        parents, source = [], []
        for p, counts in zip(proposed, leaves):
            under = np.repeat(np.arange(longest), counts)  # each leaf's spine step, step by step
            rank = np.arange(len(under)) - np.repeat(np.cumsum(counts) - counts, counts)  # its place among the step's
            parents.append(np.concatenate([np.arange(-1, p), under]))
            source.append(np.concatenate([np.arange(p + 1), 1 + longest + under * (branches - 1) + rank]))
        layout = TreeLayout.of(parents, content)
        width = layout.parent.shape[1]
        source = np.stack([np.concatenate([c, np.full(width - len(c), c[-1])]) for c in source])
        return cls(layout, parents, source, longest, proposed, branches, leaves, leaf_start)

    def candidates(self, pending: torch.Tensor, drafted: torch.Tensor, siblings: torch.Tensor) -> torch.Tensor:
        """The candidate matrix from the pending tokens [R], the proposals [R, >= P] and the siblings
        [R, >= P, b - 1]."""
        p = self.longest
        return torch.cat([pending[:, None], drafted[:, :p], siblings[:, :p].reshape(len(pending), -1)], dim=1)


def verify_tree(trees: SiblingTrees, node_choice: torch.Tensor, node_tokens: torch.Tensor):
    """(choice [R, P + 1], accepted [R], spine_accepted [R], path [R, P]) from the target's argmax
    after every node, node_choice [R, W], and the nodes' tokens [R, W]: the argmaxes along root +
    accepted path (what the row commits, a prefix of it), the path's length, how many of its first
    nodes are spine nodes (the draft's K/V of those stay valid), and the path's nodes (-1 after)."""
    dev = node_choice.device
    layout = trees.layout
    path, accepted = greedy_tree_path(node_choice, node_tokens, torch.as_tensor(layout.parent, device=dev),
                                      torch.as_tensor(layout.size, device=dev))
    path = path[:, :trees.longest]  # a path is at most as deep as the row's chain
    root = torch.zeros(len(path), 1, dtype=path.dtype, device=dev)
    along = torch.cat([root, path.clamp(min=0)], dim=1)  # [R, P + 1]
    choice = node_choice.gather(1, along)
    spine = path == torch.arange(1, trees.longest + 1, device=dev)[None, :]
    return choice, accepted, spine.long().cumprod(dim=1).sum(dim=1), path


def rejection_walk(trees: SiblingTrees, p_nodes: torch.Tensor, node_tokens: torch.Tensor, q: torch.Tensor, keys,
                   content: torch.Tensor):
    """Multi-candidate rejection sampling down each row's tree (SpecInfer's multi-step speculative
    sampling; proofs_notes/trees.md, Lemma T6): at the current spine node, with target distribution
    p' (first the node's p), each candidate child in turn, the spine child then the leaves, all
    drawn from the step's q independently, is accepted with probability min(1, p'(c) / q(c)), and
    on a reject p' becomes norm(max(0, p' - q)). A spine child accepted moves the walk down; a leaf
    accepted ends it with the next token drawn from p at the leaf; no child accepted ends it with
    the next token from p'; a node without candidates gives it from its p. The committed tokens are
    distributed as target-only sampling's. With one candidate per node this is the chain's
    Rejection.verify, draw for draw (the same keys).

    p_nodes [R, W, V] the target's processed distribution after each node, node_tokens [R, W], q
    [R, >= P, V] the draft's per step, keys (seeds, ids) [R], content
    [R]. Returns verify_tree's (choice [R, P + 1], accepted [R], spine_accepted [R], path [R, P])."""
    rows, longest, dev = len(node_tokens), trees.longest, node_tokens.device
    every = torch.arange(rows, device=dev)
    proposed = torch.as_tensor(trees.proposed, device=dev)
    leaves = torch.as_tensor(trees.leaves, device=dev)  # [R, P] (none on lookup rows: T6 needs draws from q)
    leaf_start = torch.as_tensor(trees.leaf_start, device=dev)
    width = node_tokens.shape[1]
    path = torch.full((rows, longest), -1, dtype=torch.long, device=dev)
    going = torch.ones(rows, dtype=torch.bool, device=dev)
    final = torch.zeros_like(p_nodes[:, 0])
    for depth in range(longest):
        testing = going & (depth < proposed)  # rows with candidates below spine node `depth`
        residual, q_step, child = p_nodes[:, depth], q[:, depth], torch.full_like(proposed, -1)
        for number in range(trees.branches):
            node = torch.full_like(proposed, depth + 1) if number == 0 else leaf_start[:, depth] + number - 1
            undecided = testing & (child < 0) & (number <= leaves[:, depth])
            token = node_tokens.gather(1, node.clamp(max=width - 1)[:, None])[:, 0]
            position = content + depth
            u = (rng.uniform(*keys, position, "accept") if number == 0 else
                 rng.uniform(*keys, position, "accept-sibling", torch.full_like(position, number)))
            ok = undecided & (u * q_step[every, token] < residual[every, token])
            child = torch.where(ok, node, child)
            residual = torch.where((undecided & ~ok)[:, None], residual_distribution(residual, q_step), residual)
        path[:, depth] = torch.where(testing & (child >= 0), child, -1)
        on_spine = child == depth + 1
        at_leaf = p_nodes[every, child.clamp(min=0, max=width - 1)]
        ends = going & ~on_spine
        dist = torch.where((child > depth + 1)[:, None], at_leaf, torch.where(testing[:, None], residual,
                                                                              p_nodes[:, depth]))
        final = torch.where(ends[:, None], dist, final)
        going = going & on_spine
    final = torch.where(going[:, None], p_nodes[:, longest], final)  # through the whole spine: the bonus
    accepted = (path >= 0).sum(dim=1)
    token = sample_from(final, rng.uniform(*keys, content + accepted, "sample"))
    along = torch.cat([torch.zeros(rows, 1, dtype=torch.long, device=dev), path.clamp(min=0)], dim=1)
    choice = torch.cat([node_tokens.gather(1, along[:, 1:]), token[:, None]], dim=1)
    choice.scatter_(1, accepted[:, None], token[:, None])  # the sampled token right after the path
    spine = path == torch.arange(1, longest + 1, device=dev)[None, :]
    return choice, accepted, spine.long().cumprod(dim=1).sum(dim=1), path


def path_moves(path: torch.Tensor, content: torch.Tensor, trash: int):
    """(source, target) [R, P]: node path[i, j]'s scratch slot c_i - 1 + node and the content slot
    c_i + j its K/V (and a feature draft's features) belong to; past a row's path, the trash slot."""
    depth = torch.arange(path.shape[1], device=path.device)[None, :]
    source = torch.where(path >= 0, content[:, None] - 1 + path, trash)
    target = torch.where(path >= 0, content[:, None] + depth, trash)
    return source, target


def keep_accepted_path(buffers, rows: torch.Tensor, path: torch.Tensor, content: torch.Tensor) -> None:
    """I3 after a tree verify: in each buffer (the target's SlotCache; a feature draft's FeatureBuffer),
    node path[i, j]'s entry moves to content slot c_i + j; every source is read before any write.
    Only the rows whose path leaves the spine move anything: spine node j's scratch slot c_i - 1 + j
    is its content slot (spine nodes are numbered first), so a path along the spine is in place."""
    leaves_spine = path >= 0
    leaves_spine &= path != torch.arange(1, path.shape[1] + 1, device=path.device)[None, :]
    moving = leaves_spine.any(dim=1)
    if not bool(moving.any()):
        return
    for buffer in buffers:
        buffer.keep_path(rows[moving], *path_moves(path[moving], content[moving], buffer.capacity))
