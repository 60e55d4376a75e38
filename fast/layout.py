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
