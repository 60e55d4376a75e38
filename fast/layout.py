"""The flat verify layout of a ragged round: every row's pending token and its own proposals laid
end to end, with no padding (vLLM's SpecDecodeMetadata holds the same for its batches).

Row i has content c_i and proposes p_i tokens; its queries are the pending token (content index
c_i - 1) and its proposals (c_i .. c_i - 1 + p_i), so query j of row i sits at content index and
position c_i - 1 + j (I2), sees slots 0 .. c_i - 1 + j (I4), and nothing of another row.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VerifyLayout:
    proposed: np.ndarray  # [R] proposals per row, p_i
    content: np.ndarray  # [R] content length c_i before the round's commit
    start: np.ndarray  # [R] flat index of row i's first query (its pending token)
    token_row: np.ndarray  # [N] row of each flat query, N = sum_i (p_i + 1)
    column: np.ndarray  # [N] its query number j in its row: 0 the pending token, j >= 1 proposal j
    token_index: np.ndarray  # [N] its content index and position id, c_row - 1 + j
    gather: np.ndarray  # [R, W] flat index of row i's query j, clamped to its last query (W = max_i p_i + 1)

    @classmethod
    def of(cls, proposed, content) -> "VerifyLayout":
        proposed, content = np.asarray(proposed, dtype=np.int64), np.asarray(content, dtype=np.int64)
        count = proposed + 1
        token_row = np.repeat(np.arange(len(count)), count)
        start = np.cumsum(count) - count
        column = np.arange(len(token_row)) - start[token_row]
        width = int(count.max(initial=1))
        gather = start[:, None] + np.minimum(np.arange(width)[None, :], proposed[:, None])
        return cls(proposed, content, start, token_row, column, content[token_row] - 1 + column, gather)

    @property
    def tokens(self) -> int:
        """N: the queries of the flat forward."""
        return len(self.token_row)

    def query_index(self, rows: np.ndarray, width: int) -> np.ndarray:
        """[len(rows), width]: the content index of each of these rows' queries, -1 past its last
        (what a part of the flat forward must hold, from the lengths alone)."""
        j = np.arange(width)[None, :]
        return np.where(j <= self.proposed[rows][:, None], self.content[rows][:, None] - 1 + j, -1)


@dataclass(frozen=True)
class TreeLayout:
    """The flat verify layout of a tree round: every row's root (its pending token) and its draft
    nodes laid end to end (reference.trees is the specification).

    Node j of row i writes its K/V at its own scratch slot c_i - 1 + j (nodes of one depth cannot
    share a slot), has position c_i - 1 + depth_j (I2 for trees) and sees the row's slots
    0 .. c_i - 2 and the slots of its ancestors and itself (I4 for trees). After acceptance the
    accepted path's K/V move down to c_i, c_i + 1, ... (fast.compute.slot_cache.SlotCache.keep_path);
    a chain is the tree whose node j sits at depth j, so its layout is VerifyLayout's."""

    content: np.ndarray  # [R] content length c_i before the round's commit
    size: np.ndarray  # [R] nodes per row, the root included
    start: np.ndarray  # [R] flat index of row i's root
    token_row: np.ndarray  # [N] row of each flat query, N = sum_i size_i
    column: np.ndarray  # [N] its node number in its row (0: the root)
    token_index: np.ndarray  # [N] its slot, c_row - 1 + node
    position: np.ndarray  # [N] its position id, c_row - 1 + depth
    ancestors: np.ndarray  # [N, W] bool: node b of the same row is its ancestor or itself (W = max size)
    parent: np.ndarray  # [R, W] parent node of each node (-1: the root, and past a row's last node)
    gather: np.ndarray  # [R, W] flat index of row i's node j, clamped to its last node

    @classmethod
    def of(cls, parents, content) -> "TreeLayout":
        """parents: per row, its nodes' parents (parents[i][0] = -1, then 0 <= parent < node)."""
        content = np.asarray(content, dtype=np.int64)
        size = np.array([len(p) for p in parents], dtype=np.int64)
        width = int(size.max(initial=1))
        parent = np.full((len(size), width), -1, dtype=np.int64)
        depth = np.zeros((len(size), width), dtype=np.int64)
        ancestors = np.zeros((len(size), width, width), dtype=bool)
        for i, row in enumerate(parents):
            parent[i, :len(row)] = row
        every = np.arange(len(size))
        ancestors[:, 0, 0] = True
        for node in range(1, width):  # parents come first: node's parent is final already, in every row
            up = np.maximum(parent[:, node], 0)  # nodes past a row's last hang under its root, unread
            depth[:, node] = depth[every, up] + 1
            ancestors[:, node] = ancestors[every, up]
            ancestors[:, node, node] = True
        token_row = np.repeat(np.arange(len(size)), size)
        start = np.cumsum(size) - size
        column = np.arange(len(token_row)) - start[token_row]
        gather = start[:, None] + np.minimum(np.arange(width)[None, :], size[:, None] - 1)
        return cls(content, size, start, token_row, column, content[token_row] + column - 1,
                   content[token_row] - 1 + depth[token_row, column], ancestors[token_row, column], parent, gather)

    @property
    def tokens(self) -> int:
        """N: the queries of the flat forward."""
        return len(self.token_row)
