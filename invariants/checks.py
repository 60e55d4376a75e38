"""Checkers for the invariants I1-I6 and S1-S4 (see proofs_notes/ and docs/guarantees.md).

Every checker takes NumPy arrays or torch tensors and returns a list of `Violation`s (empty when
the invariant holds); none of them asserts. They are written from the statements of the
invariants, independently of the engines they check, so they can judge any engine.
"""
from __future__ import annotations

from typing import Callable, Iterable

from dataclasses import replace

import numpy as np

from .violations import Violation, as_numpy

MASKED_BELOW = -1.0  # an additive float mask entry below this hides the slot


def allowed_from_mask(mask) -> np.ndarray:
    """Bool [.., Q, S] from a bool mask or an additive float mask (0 visible, very negative hidden)."""
    m = as_numpy(mask)
    return m if m.dtype == bool else m > MASKED_BELOW


def check_alignment(pad_len, content_len, width: int) -> list[Violation]:
    """I1: in a rectangular layout pad_len + content_len == L for every row."""
    pad_len, content_len = as_numpy(pad_len), as_numpy(content_len)
    return [Violation("I1", "pad_len + content_len != batch width", row=i, expected=width,
                      actual=int(pad_len[i] + content_len[i]))
            for i in np.nonzero(pad_len + content_len != width)[0]]


def check_positions(position_ids, query_index) -> list[Violation]:
    """I2: the position id of a query holding content index j is exactly j (pad queries: any)."""
    pos, idx = as_numpy(position_ids), as_numpy(query_index)
    bad = (idx >= 0) & (pos != idx)
    return [Violation("I2", "position id differs from the content index", row=int(i), index=int(idx[i, q]),
                      expected=int(idx[i, q]), actual=int(pos[i, q])) for i, q in zip(*np.nonzero(bad))]


def expected_visibility(query_index, slot_index, window: int | None = None) -> np.ndarray:
    """What I4 demands: query q sees the slots holding content max(0, q-W+1)..q of its own row."""
    q, s = as_numpy(query_index)[:, :, None], as_numpy(slot_index)[:, None, :]
    visible = (s >= 0) & (s <= q) & (q >= 0)
    if window is not None:
        visible &= s > q - window
    return visible


def check_mask(mask, query_index, slot_index, window: int | None = None) -> list[Violation]:
    """I4 on a mask [B, Q, S] (or [B, 1, Q, S]): exactly content 0..q of the row, nothing else.

    query_index: [B, Q] content index of each query (negative: a pad query, not checked).
    slot_index: [B, S] content index each slot holds for this forward (negative: pad or stale).
    """
    allowed = allowed_from_mask(mask)
    if allowed.ndim == 4:
        allowed = allowed[:, 0]
    want = expected_visibility(query_index, slot_index, window)
    real = as_numpy(query_index)[:, :, None] >= 0
    bad = (allowed != want) & real
    out = []
    for i, q, s in zip(*np.nonzero(bad)):
        what = "sees a slot it must not" if allowed[i, q, s] else "cannot see a slot of its own prefix"
        out.append(Violation("I4", f"query {int(as_numpy(query_index)[i, q])} {what} (slot {int(s)})",
                             row=int(i), index=int(s), expected=bool(want[i, q, s]), actual=bool(allowed[i, q, s])))
    return out


def check_tree_forward(position_ids, mask, content_len, parents, capacity: int, window: int | None = None
                       ) -> list[Violation]:
    """I2 and I4 for a tree verify: row i's node j (node 0 the root, the row's pending token;
    parents[i][j] its parent) has position content_len[i] - 1 + its depth, and sees exactly the
    cached slots 0..content_len[i] - 2 and its ancestors and itself among the row's nodes, within
    the window by position. mask [B, Q, capacity + Q]: the cache's slots, then the nodes.
    Queries past a row's nodes are pads, not checked."""
    pos, allowed = as_numpy(position_ids), allowed_from_mask(mask)
    out = []
    for i, parent in enumerate(parents):
        chains = []  # per node, the nodes from it up to the root
        for node in range(len(parent)):
            chain = [node]
            while chain[-1] > 0:
                chain.append(int(parent[chain[-1]]))
            chains.append(chain)
        base = int(content_len[i]) - 1
        for node, chain in enumerate(chains):
            want_pos = base + len(chain) - 1
            if pos[i, node] != want_pos:
                out.append(Violation("I2", f"tree node {node} at depth {len(chain) - 1} has the wrong position",
                                     row=i, index=node, expected=want_pos, actual=int(pos[i, node])))
            want = np.zeros(allowed.shape[-1], dtype=bool)
            want[:max(base, 0)] = True
            want[[capacity + a for a in chain]] = True
            if window is not None:
                slot_pos = np.concatenate([np.arange(capacity), base + np.array([len(c) - 1 for c in chains]),
                                           np.zeros(allowed.shape[-1] - capacity - len(chains), dtype=np.int64)])
                want &= slot_pos > want_pos - window
            for col in np.nonzero(allowed[i, node] != want)[0]:
                what = "sees a slot it must not" if allowed[i, node, col] else "cannot see a slot of its own path"
                where = f"slot {col}" if col < capacity else f"node {col - capacity}"
                out.append(Violation("I4", f"tree node {node} {what} ({where})", row=i, index=int(col),
                                     expected=bool(want[col]), actual=bool(allowed[i, node, col])))
    return out


def check_packed_forward(position_ids, mask, lengths, window: int | None = None) -> list[Violation]:
    """I2 and I4 for a packed forward: one sequence [1, T] holding several prompts back to back
    (lengths[s] tokens of prompt s, in order). Token j of prompt s must have position j and see
    exactly tokens 0..j of prompt s (with a window W: the last W). Expected values come from the
    lengths alone; `row` in a violation is the prompt's place in the pack."""
    segment = np.repeat(np.arange(len(lengths)), lengths)
    index = np.concatenate([np.arange(n) for n in lengths]) if len(lengths) else np.zeros(0, dtype=np.int64)
    pos = as_numpy(position_ids).reshape(-1)
    out = [Violation("I2", "position id differs from the content index in a packed forward", row=int(segment[t]),
                     index=int(index[t]), expected=int(index[t]), actual=int(pos[t]))
           for t in np.nonzero(pos != index)[0]]
    allowed = allowed_from_mask(mask).reshape(len(index), len(index))
    want = (segment[:, None] == segment[None, :]) & (index[None, :] <= index[:, None])
    if window is not None:
        want &= index[None, :] > index[:, None] - window
    for q, k in zip(*np.nonzero(allowed != want)):
        what = "sees a token it must not" if allowed[q, k] else "cannot see a token of its own prefix"
        out.append(Violation("I4", f"packed query {int(index[q])} of prompt {int(segment[q])} {what} (pack slot "
                                   f"{int(k)}: prompt {int(segment[k])}, content {int(index[k])})",
                             row=int(segment[q]), index=int(k), expected=bool(want[q, k]), actual=bool(allowed[q, k])))
    return out


def check_kv(keys, slot_index, valid_len, recompute: Callable[[int], np.ndarray], rows: Iterable[int] | None = None,
             rtol: float = 1e-4, atol: float = 1e-5, name: str = "cache") -> list[Violation]:
    """I3: every visible slot of row i holds the K (or V) of its content index, as a fresh unpadded
    prefill computes it. keys: [B, S, ...]; slot_index: [B, S]; valid_len[i]: content indices
    0..valid_len-1 must be present; recompute(i) -> [T, ...] for row i. Returns one violation per
    row at its first wrong slot."""
    keys, slot_index, valid_len = as_numpy(keys), as_numpy(slot_index), as_numpy(valid_len)
    out = []
    for i in (range(keys.shape[0]) if rows is None else rows):
        fresh = as_numpy(recompute(i))
        idx = slot_index[i]
        present = sorted(int(j) for j in idx[(idx >= 0) & (idx < valid_len[i])])
        if present != list(range(int(valid_len[i]))):
            out.append(Violation("I3", f"{name}: the slots do not hold content 0..{int(valid_len[i]) - 1} once each",
                                 row=i, expected=int(valid_len[i]), actual=len(present)))
            continue
        for s in np.nonzero((idx >= 0) & (idx < valid_len[i]))[0]:
            j = int(idx[s])
            if not np.allclose(keys[i, s], fresh[j], rtol=rtol, atol=atol):
                err = float(np.max(np.abs(keys[i, s] - fresh[j])))
                out.append(Violation("I3", f"{name}: slot {int(s)} does not hold the K/V of content {j}",
                                     row=i, index=j, expected="fresh prefill value", actual=f"max abs error {err:.3g}"))
                break
    return out


def check_proposal_lengths(proposed, confidence, limit, threshold: float, floor: float | None = None
                           ) -> list[Violation]:
    """I7: row i proposed exactly as many drafts as the proposal rule gives from its own confidences
    at each draft step [R, S] and its limit min(k, remaining - 1, cap): the leading steps with
    confidence >= threshold, then the step that stopped it if its confidence is >= floor (None:
    floor = threshold), at most limit (fast.proposals). A length that follows a neighbour's
    confidences, or the round's longest proposal, breaks it."""
    proposed, limit = as_numpy(proposed).astype(int), as_numpy(limit).astype(int)
    confidence = as_numpy(confidence).astype(float).reshape(len(proposed), -1)
    out = []
    for i in range(len(proposed)):
        want = 0
        steps = min(limit[i], confidence.shape[1])
        while want < steps and confidence[i, want] >= threshold:
            want += 1
        if want < steps and floor is not None and confidence[i, want] >= floor:
            want += 1  # the step below the threshold still proposes its token
        if proposed[i] != want:
            out.append(Violation("I7", "proposal length is not the rule's (own confidences, limit, threshold, floor)",
                                 row=i, index=want, expected=want, actual=int(proposed[i])))
    return out


def check_goodput_lengths(proposed, confidence, limit, worth, calibration, bar: float) -> list[Violation]:
    """I7 for the goodput rule (fast.proposals.GoodputRule): row i proposed exactly the leading
    steps j < limit_i at which worth_i * prod_{j' <= j} min(calibration_i * confidence_ij', 1) >= bar,
    from its own confidences, worth and calibration and the round's bar."""
    proposed, limit = as_numpy(proposed).astype(int), as_numpy(limit).astype(int)
    confidence = as_numpy(confidence).astype(float).reshape(len(proposed), -1)
    out = []
    for i in range(len(proposed)):
        want, reach = 0, 1.0
        while want < min(limit[i], confidence.shape[1]):
            reach *= min(float(calibration[i]) * confidence[i, want], 1.0)
            if float(worth[i]) * reach < bar:
                break
            want += 1
        if proposed[i] != want:
            out.append(Violation("I7", "proposal length is not the goodput rule's (own confidences, worth, "
                                       "calibration, limit; the round's bar)",
                                 row=i, index=want, expected=want, actual=int(proposed[i])))
    return out


def check_threshold_leaves(leaves, proposed, available) -> list[Violation]:
    """I7 for a tree's leaves under the threshold rule (fast.proposals.ThresholdRule): every
    candidate the step has (available [R, steps]) under each of a row's proposals, and none past them."""
    leaves, proposed = as_numpy(leaves).astype(int), as_numpy(proposed).astype(int)
    available = as_numpy(available).astype(int)
    out = []
    for i in range(len(proposed)):
        for j in range(leaves.shape[1]):
            want = available[i, j] if j < proposed[i] else 0
            if leaves[i, j] != want:
                out.append(Violation("I7", "leaf count is not the threshold rule's (every candidate under "
                                           "each proposal)", row=i, index=j, expected=want,
                                     actual=int(leaves[i, j])))
    return out


def check_goodput_leaves(leaves, runner_ups, confidence, proposed, available, worth, calibration,
                         leaf_calibration, bar: float) -> list[Violation]:
    """I7 for a tree's leaves under the goodput rule (fast.proposals.GoodputRule): under row i's
    proposal at step j < p_i, the leading r < available_ij for which worth_i * prod_{j' < j}
    min(calibration_i * confidence_ij', 1) * min(leaf_calibration_i * runner_up_ijr, 1) >= bar;
    none past the row's proposals."""
    leaves, proposed = as_numpy(leaves).astype(int), as_numpy(proposed).astype(int)
    runner_ups = as_numpy(runner_ups).astype(float)
    confidence = as_numpy(confidence).astype(float).reshape(len(proposed), -1)
    available = as_numpy(available).astype(int)
    out = []
    for i in range(len(proposed)):
        reach = 1.0
        for j in range(leaves.shape[1]):
            want = 0
            if j < proposed[i]:
                while want < available[i, j] and float(worth[i]) * reach * min(
                        float(leaf_calibration[i]) * runner_ups[i, j, want], 1.0) >= bar:
                    want += 1
                reach *= min(float(calibration[i]) * confidence[i, j], 1.0)
            if leaves[i, j] != want:
                out.append(Violation("I7", "leaf count is not the goodput rule's (own runner-up probabilities, "
                                           "reach, worth, leaf calibration; the round's bar)",
                                     row=i, index=j, expected=want, actual=int(leaves[i, j])))
    return out


def check_distinct_candidates(drafted, siblings, leaves, most: int) -> list[Violation]:
    """I7 for a greedy or coupled tree: under each spine node the candidates (the proposal d_j and
    the step's leaves) are distinct tokens, and a step offers at most `most` leaves; so the target's
    choice is at most one child, and no verify token goes to a copy."""
    drafted, siblings, leaves = as_numpy(drafted), as_numpy(siblings), as_numpy(leaves).astype(int)
    out = []
    for i in range(leaves.shape[0]):
        for j in range(leaves.shape[1]):
            tokens = [int(drafted[i, j])] + [int(t) for t in siblings[i, j, :leaves[i, j]]]
            if len(set(tokens)) != len(tokens) or leaves[i, j] > most:
                out.append(Violation("I7", "a spine node's candidates repeat a token (or exceed the tree's "
                                           "branches)", row=i, index=j, expected=most, actual=tokens))
    return out


def check_round_commit(drafted, choice, limit, accepted, committed, remaining, eos_ids,
                       stopped=None) -> list[Violation]:
    """I5 and I6 for one greedy round, row by row.

    I5: accepted = length of the agreeing prefix of drafts and target choices (at most limit);
    the committed tokens are the target's choices choice[:n]. I6: n = min(accepted + 1, remaining,
    first EOS among the new tokens + 1), or, in a row a stop string ended (stopped [R] bools), at
    least one token fewer.
    """
    drafted, choice = as_numpy(drafted), as_numpy(choice)
    eos = set(int(e) for e in eos_ids)
    out = []
    for i in range(choice.shape[0]):
        lim, acc = int(as_numpy(limit)[i]), int(as_numpy(accepted)[i])
        want_acc = 0
        while want_acc < lim and drafted[i, want_acc] == choice[i, want_acc]:
            want_acc += 1
        if acc != want_acc:
            out.append(Violation("I5", "accepted count is not the agreeing prefix of drafts and target choices",
                                 row=i, index=want_acc, expected=want_acc, actual=acc))
            continue
        want = choice[i, : min(acc + 1, int(as_numpy(remaining)[i]))].tolist()
        for j, token in enumerate(want):
            if token in eos:
                want = want[: j + 1]
                break
        got = list(committed[i])
        if stopped is not None and stopped[i] and 0 < len(got) <= len(want):
            want = want[:len(got)]  # where the stop string ends is judged against reference.processors
        if got != want:
            j = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            inv = "I6" if len(got) > len(want) and got[: len(want)] == want else "I5"  # kept past the stop
            out.append(Violation(inv, "committed tokens differ from the target's choices under the stop rule",
                                 row=i, index=j, expected=want, actual=got))
    return out


def check_tree_commit(parents, node_tokens, node_choice, accepted, committed, remaining, eos_ids,
                      stopped=None, path=None, choice=None) -> list[Violation]:
    """I5 and I6 for one tree round, row by row (reference.trees.greedy_path).

    Greedy or coupled (node_choice [R, W] the target's choice after each node; node_tokens [R, W]
    the nodes' tokens; parents[i] row i's parents): I5, the accepted path walks from the root to the
    child carrying the target's choice at the current node while one does, and accepted is its
    length. Rejection sampling (node_choice None): the given path [R, P] (-1 after its end) must
    run from the root down parent links, accepted is its length, and the committed tokens are its
    tokens then choice[i, accepted] [R, P + 1]. I6 then holds as for the chain of the path's tokens
    (check_round_commit)."""
    node_tokens = as_numpy(node_tokens)
    node_choice = None if node_choice is None else as_numpy(node_choice)
    out = []
    for i, parent in enumerate(parents):
        if node_choice is not None:
            row_path, node = [], 0
            while True:
                child = [j for j in range(1, len(parent))
                         if parent[j] == node and node_tokens[i, j] == node_choice[i, node]]
                if not child:
                    break
                node = child[0]
                row_path.append(node)
            along = node_choice[i, [0] + row_path]
        else:
            row_path = [int(v) for v in as_numpy(path)[i] if v >= 0]
            links = [0] + row_path
            if any(parent[b] != a for a, b in zip(links, links[1:])):
                out.append(Violation("I5", "the accepted path does not run down the tree's parent links", row=i,
                                     index=0, expected="a root path", actual=row_path))
                continue
            along = np.concatenate([node_tokens[i, row_path], as_numpy(choice)[i, len(row_path):len(row_path) + 1]])
        acc = int(as_numpy(accepted)[i])
        if acc != len(row_path):
            out.append(Violation("I5", "accepted count is not the length of the tree's accepted path", row=i,
                                 index=len(row_path), expected=len(row_path), actual=acc))
            continue
        found = check_round_commit(node_tokens[i, row_path][None], along[None], [acc], [acc], [committed[i]],
                                   [as_numpy(remaining)[i]], eos_ids, None if stopped is None else [stopped[i]])
        out += [replace(v, row=i) for v in found]
    return out


def check_stop(sequence, eos_ids, max_new_tokens: int, request: int | None = None) -> list[Violation]:
    """I6 on a finished request: it ends at its first EOS (kept) or at exactly max_new_tokens."""
    seq = [int(t) for t in as_numpy(sequence).reshape(-1)]
    eos = set(int(e) for e in eos_ids)
    first = next((j for j, t in enumerate(seq) if t in eos), None)
    if first is not None and first != len(seq) - 1:
        return [Violation("I6", "tokens follow the first EOS", row=request, index=first + 1,
                          expected=first + 1, actual=len(seq))]
    if len(seq) > max_new_tokens:
        return [Violation("I6", "more tokens than max_new_tokens", row=request, index=max_new_tokens,
                          expected=max_new_tokens, actual=len(seq))]
    if first is None and len(seq) != max_new_tokens:
        return [Violation("I6", "stopped before max_new_tokens without an EOS", row=request, index=len(seq),
                          expected=max_new_tokens, actual=len(seq))]
    return []


def check_outputs(sequences, oracle) -> list[Violation]:
    """I5 end to end: each request's tokens equal the oracle's (target-only greedy at batch 1)."""
    out = []
    for r, (got, want) in enumerate(zip(sequences, oracle)):
        got, want = [int(t) for t in got], [int(t) for t in want]
        if got != want:
            j = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            out.append(Violation("I5", "output differs from target-only greedy decoding", row=r, index=j,
                                 expected=want[j] if j < len(want) else "end", actual=got[j] if j < len(got) else "end"))
    if len(sequences) != len(oracle):
        out.append(Violation("S1", "number of results differs from number of requests",
                             expected=len(oracle), actual=len(sequences)))
    return out


def check_conservation(requests: Iterable[int], members: dict) -> list[Violation]:
    """S1: each request is in exactly one of queue, pool, running, done."""
    seen: dict = {}
    for place, ids in members.items():
        for r in ids:
            seen.setdefault(int(r), []).append(place)
    out = []
    for r in requests:
        places = seen.pop(int(r), [])
        if len(places) != 1:
            out.append(Violation("S1", f"request is in {len(places)} places {places}", row=int(r), expected=1,
                                 actual=len(places)))
    for r, places in seen.items():
        out.append(Violation("S1", f"unknown request found in {places}", row=r))
    return out


def check_order(returned_ids, expected_ids) -> list[Violation]:
    """S2: results come back in input order with their request ids."""
    got, want = [int(x) for x in returned_ids], [int(x) for x in expected_ids]
    if got == want:
        return []
    j = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return [Violation("S2", "results are not in input order", index=j,
                      expected=want[j] if j < len(want) else "end", actual=got[j] if j < len(got) else "end")]


def check_liveness(waits: dict, bound: int, unfinished: Iterable[int] = ()) -> list[Violation]:
    """S3: no runnable request waited more than `bound` consecutive rounds; none is left unfinished."""
    out = [Violation("S3", "request waited too many rounds", row=int(r), expected=f"<= {bound}", actual=int(w))
           for r, w in waits.items() if w > bound]
    out += [Violation("S3", "request never finished", row=int(r)) for r in unfinished]
    return out


def check_composition(outputs, baseline, label: str = "") -> list[Violation]:
    """S4: a request's output does not depend on its neighbours, batch size or strategy."""
    out = []
    for r, (got, want) in enumerate(zip(outputs, baseline)):
        got, want = [int(t) for t in got], [int(t) for t in want]
        if got != want:
            j = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            out.append(Violation("S4", f"output changed with the composition {label}".strip(), row=r, index=j,
                                 expected=want[j] if j < len(want) else "end", actual=got[j] if j < len(got) else "end"))
    return out
