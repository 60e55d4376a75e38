"""Batch state of the two layouts, with masks, position ids and slot maps derived from lengths.

Nothing here looks at token values to decide what is padding: a pad id inside content, or
pad == eos, changes nothing (the known mistake of deriving masks from `token == pad_id`).

Rectangular (left-padded) layout, used by EQSPEC and EXSPEC batches:
    row i has `pad_len[i]` pad columns, then its `content_len[i]` content tokens; I1 says
    pad_len + content_len == L for every row, so every row's last (pending) token is column L-1.
    Column s holds content index s - pad_len[i]; the KV cache slot of column s is s.

Ragged layout (ours):
    row i owns one row of a buffer of `capacity` slots; content index j lives in slot j and has
    position j, so nothing is ever padded or moved. Slots past the committed content are stale
    (rejected drafts, old requests) and are masked because every query q sees only slots <= q.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def query_mask(query_index: np.ndarray, slot_index: np.ndarray, window: int | None = None) -> np.ndarray:
    """I4 as a formula: query of content index q sees exactly the slots holding content 0..q.

    query_index: [B, Q] content index of each query (negative for a pad query, which sees nothing
    but itself is never read). slot_index: [B, S] content index held by each slot (negative for pads).
    Returns bool [B, Q, S].
    """
    q = query_index[:, :, None]
    s = slot_index[:, None, :]
    allowed = (s >= 0) & (s <= q)
    if window is not None:
        allowed &= s > q - window
    return allowed


@dataclass
class RectState:
    """Tokens of a left-padded batch and the per-row content lengths; everything else is derived."""

    tokens: np.ndarray  # [B, L]
    content_len: np.ndarray  # [B]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @property
    def pad_len(self) -> np.ndarray:
        return self.width - self.content_len

    @classmethod
    def from_rows(cls, rows, pad_id: int = 0) -> "RectState":
        """Left-pad a list of token lists (the `repad` of unpad, append, repad)."""
        content_len = np.array([len(r) for r in rows], dtype=np.int64)
        width = int(content_len.max(initial=0))
        tokens = np.full((len(rows), width), pad_id, dtype=np.int64)
        for i, row in enumerate(rows):
            tokens[i, width - len(row):] = row
        return cls(tokens, content_len)

    def rows(self) -> list[list[int]]:
        """Content of each row without padding (the `unpad`)."""
        return [self.tokens[i, p:].tolist() for i, p in enumerate(self.pad_len)]

    def slot_index(self, columns: int | None = None) -> np.ndarray:
        """Content index held by each column/slot, [B, columns]; negative on padding."""
        columns = self.width if columns is None else columns
        return np.arange(columns)[None, :] - self.pad_len[:, None]

    def position_ids(self, cols: np.ndarray) -> np.ndarray:
        """I2: position of column c of row i is its content index c - pad_len[i] (0 on pads, masked)."""
        return np.maximum(np.asarray(cols)[None, :] - self.pad_len[:, None], 0)

    def attention_mask(self) -> np.ndarray:
        """The 2D key mask [B, L]: True on content, derived from pad_len only."""
        return self.slot_index() >= 0


@dataclass
class RaggedState:
    """Per-row lengths in a buffer of fixed capacity; slot j of a row holds its content index j."""

    tokens: np.ndarray  # [rows, capacity]; only [:content_len] is meaningful
    content_len: np.ndarray  # [rows]
    request: np.ndarray  # [rows], -1 for a free row
    target_pending: np.ndarray  # [rows]: committed tokens without target K/V (1 between rounds)
    draft_pending: np.ndarray  # [rows]: committed tokens without draft K/V (1, or 2 after a full accept)
    prompt_len: np.ndarray  # [rows]
    budget_end: np.ndarray  # [rows]: prompt_len + max_new_tokens, the content length that stops the row

    @classmethod
    def empty(cls, rows: int, capacity: int) -> "RaggedState":
        z = np.zeros(rows, dtype=np.int64)
        return cls(np.zeros((rows, capacity), dtype=np.int64), z.copy(), np.full(rows, -1), z.copy(), z.copy(),
                   z.copy(), z.copy())

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    @property
    def active(self) -> np.ndarray:
        return self.request >= 0

    def slot_index(self) -> np.ndarray:
        """Content index of every slot: the slot number itself (no padding exists)."""
        return np.broadcast_to(np.arange(self.capacity), self.tokens.shape)

    def content(self, row: int) -> list[int]:
        return self.tokens[row, : self.content_len[row]].tolist()
