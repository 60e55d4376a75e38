"""One round of batch speculative decoding, on plain arrays.

A round: every active row proposes p_i drafts `drafted[i, :p_i]` (its proposal length, from its
own draft confidences: `proposal_lengths`); the target's choice after the pending token and after
each draft is `choice[i, :p_i + 1]` (argmax for greedy). Row i accepts the drafts up to the first
mismatch (at most `limit[i]` = p_i), then commits `accepted + 1` tokens
`choice[i, :accepted + 1]` (the correction on a reject, the bonus on a full accept), fewer when
it reaches an EOS id or its budget (I5, I6).
"""
from __future__ import annotations

import numpy as np

from .state import RaggedState, RectState


def proposal_lengths(confidence: np.ndarray, limit: np.ndarray, threshold: float, floor: float | None = None
                     ) -> np.ndarray:
    """How many drafts each row proposes (I7), at most limit[i] = min(k, remaining - 1, the round's
    cap): the leading draft steps whose confidence (the probability of the draft distribution's most
    likely token) is >= threshold, and the step that stops the row too if its confidence is >= floor
    (floor <= threshold; None: floor = threshold, the stopping step never proposes).
    confidence: [rows, steps run]."""
    floor = threshold if floor is None else floor
    confidence = np.asarray(confidence, dtype=float).reshape(len(limit), -1)
    allowed = np.arange(confidence.shape[1])[None, :] < np.asarray(limit)[:, None]
    earlier_passed = np.cumprod(np.pad(confidence >= threshold, ((0, 0), (1, 0)), constant_values=True), axis=1)[:, :-1]
    return np.cumprod(earlier_passed & (confidence >= floor) & allowed, axis=1).sum(axis=1).astype(np.int64)


def softmax_max(logits: np.ndarray) -> np.ndarray:
    """The probability of the most likely token of softmax(logits) along the last axis."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return 1.0 / np.exp(shifted).sum(axis=-1)


def greedy_accept(drafted: np.ndarray, choice: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """Accepted drafts per row: the length of the agreeing prefix, capped at limit[i] (I5)."""
    k = drafted.shape[1]
    agree = drafted == choice[:, :k]
    agree &= np.arange(k)[None, :] < np.asarray(limit)[:, None]
    return np.cumprod(agree, axis=1).sum(axis=1).astype(np.int64)


def commit_counts(choice: np.ndarray, accepted: np.ndarray, remaining: np.ndarray, eos_ids) -> tuple[np.ndarray, np.ndarray]:
    """Tokens committed per row, and whether the row ends on EOS.

    n = min(accepted + 1, remaining, index of the first EOS among the new tokens + 1) (I6). Only the
    tokens of this round are searched for EOS, never the prompt or earlier tokens.
    """
    width = choice.shape[1]
    n = np.minimum(np.asarray(accepted) + 1, np.asarray(remaining))
    is_eos = np.isin(choice, np.asarray(list(eos_ids), dtype=np.int64))
    is_eos &= np.arange(width)[None, :] < n[:, None]
    first_eos = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1), width)
    hit_eos = first_eos < n
    return np.where(hit_eos, first_eos + 1, n).astype(np.int64), hit_eos


def committed_tokens(choice: np.ndarray, drafted: np.ndarray, n: np.ndarray) -> list[list[int]]:
    """The tokens each row commits: the target's choices choice[i, :n[i]] (drafts agreeing with the
    target are the same tokens; the last one is the correction or the bonus, always the target's)."""
    return [choice[i, : n[i]].tolist() for i in range(choice.shape[0])]


def eqspec_update(state: RectState, new_tokens: np.ndarray, n: np.ndarray, pad_id: int = 0) -> tuple[RectState, np.ndarray]:
    """Unpad, append n[i] tokens of new_tokens[i], repad. Returns the new state and δ = p' - p.

    Keeps I1 (from_rows right-aligns every row). Theorem B.1: L' = max(c + n), p' = L' - c - n,
    so δ = 0 for every row when all rows commit the same number of tokens.
    """
    rows = [row + new_tokens[i, : n[i]].tolist() for i, row in enumerate(state.rows())]
    new_state = RectState.from_rows(rows, pad_id)
    return new_state, new_state.pad_len - state.pad_len


def realign_source(pad_len: np.ndarray, n: np.ndarray, width: int, new_width: int) -> np.ndarray:
    """The EQSPEC update as one gather: new column j' of row i comes from extended column j' - δ_i.

    Extended columns are the old L columns followed by the new tokens (and their cache slots).
    δ_i = L' - L - n_i. Entries that land on padding are negative. This is what the fast path does
    on every cache tensor; `eqspec_update` is the literal definition it must agree with.
    """
    delta = new_width - width - np.asarray(n)
    source = np.arange(new_width)[None, :] - delta[:, None]
    return np.where(source >= np.asarray(pad_len)[:, None], source, -1)


def ragged_commit(state: RaggedState, rows: np.ndarray, committed: list[list[int]]) -> None:
    """Write each row's committed tokens at its own offset content_len; nothing else moves."""
    for row, tokens in zip(rows, committed):
        start = state.content_len[row]
        state.tokens[row, start: start + len(tokens)] = tokens
        state.content_len[row] += len(tokens)
