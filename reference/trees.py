"""Token trees: several candidates per position, verified by the target in one forward.

A row's tree has a root, the row's pending token (content index c - 1), and draft nodes 1..n in
topological order (parent[j] < j; the root's parent is -1). Node j's depth is one more than its
parent's (the root's is 0), and its position is c - 1 + depth[j]: the position it would have on
the chain from the root to it. A chain is the tree whose node j hangs under node j - 1.

In the verify forward each node sees the row's cached content (slots 0..c - 2) and its own
ancestors and itself among the tree's nodes, never a sibling or a cousin: those are other
candidates for the same positions (I4 for trees). Its logits are then the target's logits after
the sequence content + the path from the root to it.

Greedy acceptance walks from the root: the target's argmax at a node picks the child carrying
that token (siblings carry distinct tokens), until no child carries it. The walk's nodes after
the root are the accepted path; the argmaxes along root + path are the committed tokens (the last
one is the correction, or the bonus at a leaf): exactly what target-only greedy decoding makes
(proofs_notes/trees.md). Only the K/V of the root and of the path are kept, moved to the content
slots c - 1, c, ... they belong to (I3); the other nodes' K/V never reach the cache.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from ..invariants import check_tree_forward, raise_if
from .engine import ReferenceResult, _check_slot_caches, prefill
from .rounds import commit_counts, ragged_commit
from .state import RaggedState
from .toy_lm import ToyLM


@dataclass(frozen=True)
class Tree:
    """One row's candidates: tokens[0] is the root (the pending token), parent[0] = -1."""

    tokens: np.ndarray  # [n + 1]
    parent: np.ndarray  # [n + 1]

    def __post_init__(self):
        tokens, parent = np.asarray(self.tokens, dtype=np.int64), np.asarray(self.parent, dtype=np.int64)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parent", parent)
        if tokens.ndim != 1 or tokens.shape != parent.shape or len(tokens) == 0:
            raise ValueError("a tree needs one token and one parent per node, the root first")
        later = parent[1:]
        if parent[0] != -1 or not ((later >= 0) & (later < np.arange(1, len(parent)))).all():
            raise ValueError(f"parents must come first: parent[0] == -1 and 0 <= parent[j] < j, got {parent.tolist()}")
        for node in range(len(tokens)):
            siblings = tokens[self.children(node)]
            if len(np.unique(siblings)) != len(siblings):
                raise ValueError(f"node {node}'s children carry a token twice: {siblings.tolist()}")

    @classmethod
    def chain(cls, root: int, drafted) -> "Tree":
        """The chain root, d_1, ..., d_k as a tree."""
        drafted = [int(t) for t in drafted]
        return cls(np.array([root] + drafted), np.arange(-1, len(drafted)))

    @property
    def size(self) -> int:
        """Nodes including the root."""
        return len(self.tokens)

    @property
    def depth(self) -> np.ndarray:
        """[n + 1]: 0 at the root, parent's depth + 1 elsewhere."""
        depth = np.zeros(self.size, dtype=np.int64)
        for node in range(1, self.size):
            depth[node] = depth[self.parent[node]] + 1
        return depth

    def children(self, node: int) -> np.ndarray:
        return np.nonzero(self.parent == node)[0]

    def ancestors(self) -> np.ndarray:
        """[n + 1, n + 1] bool: True where column b is node a's ancestor or a itself."""
        seen = np.eye(self.size, dtype=bool)
        for node in range(1, self.size):
            seen[node] |= seen[self.parent[node]]
        return seen

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's first child down to node (empty for the root)."""
        path = []
        while node > 0:
            path.append(node)
            node = int(self.parent[node])
        return path[::-1]


def greedy_path(tree: Tree, choice: np.ndarray) -> list[int]:
    """The accepted nodes: from the root, follow the child carrying the target's argmax at the
    current node (choice [n + 1], per node) while one does."""
    path, node = [], 0
    while True:
        match = [int(j) for j in tree.children(node) if tree.tokens[j] == choice[node]]
        if not match:
            return path
        node = match[0]
        path.append(node)


def tree_inputs(trees: list[Tree], content: np.ndarray, pad_id: int):
    """The flat-per-row inputs of one tree verify, padded to the widest tree.

    Returns tokens [R, Q], positions [R, Q] (content - 1 + depth; 0 on pad queries), real [R, Q]
    (False on pad queries) and ancestors [R, Q, Q]."""
    width = max(t.size for t in trees)
    tokens = np.full((len(trees), width), pad_id, dtype=np.int64)
    positions = np.zeros((len(trees), width), dtype=np.int64)
    real = np.zeros((len(trees), width), dtype=bool)
    ancestors = np.zeros((len(trees), width, width), dtype=bool)
    for i, tree in enumerate(trees):
        tokens[i, :tree.size] = tree.tokens
        positions[i, :tree.size] = content[i] - 1 + tree.depth
        real[i, :tree.size] = True
        ancestors[i, :tree.size, :tree.size] = tree.ancestors()
    return tokens, positions, real, ancestors


def forward_tree(model: ToyLM, cache, rows, trees: list[Tree], content: np.ndarray, window: int | None, pad_id: int):
    """The target's forward over every row's tree nodes. Writes nothing to the cache: which K/V
    stay is decided by acceptance (keep_path).

    cache: per layer (K, V) [slots, capacity, D], row r's slots 0..content - 2 valid. Query a of a
    row sees those slots and its ancestors-or-self among the row's nodes (I4 for trees), each only
    within the sliding window, by position. Returns logits [R, Q, V], the nodes' K/V per layer
    [R, Q, D], and what the forward saw (positions [R, Q], allowed [R, Q, capacity + Q])."""
    capacity = cache[0][0].shape[1]
    tokens, positions, real, ancestors = tree_inputs(trees, content, pad_id)
    slot = np.arange(capacity)[None, None, :]
    cached = np.broadcast_to(slot < (content - 1)[:, None, None], (len(rows), tokens.shape[1], capacity)).copy()
    own = ancestors.copy()
    if window is not None:
        cached &= slot > positions[:, :, None] - window
        own &= positions[:, None, :] > positions[:, :, None] - window
    allowed = np.concatenate([cached, own], axis=2) & real[:, :, None]
    past = [(k[rows], v[rows]) for k, v in cache]
    logits, new_kv = model.forward(tokens, positions, past, allowed)
    return logits, new_kv, dict(positions=positions, allowed=allowed)


def keep_path(cache, rows, new_kv, paths: list[list[int]], content: np.ndarray) -> None:
    """I3 after a tree round: the root's K/V goes to slot c - 1 and the j-th node of the row's kept
    path (the accepted nodes whose tokens it commits before its new pending token) to slot c - 1 + j,
    its content index; no other node's K/V is written."""
    for i, (row, path) in enumerate(zip(rows, paths)):
        nodes = [0] + list(path)
        slots = content[i] - 1 + np.arange(len(nodes))
        for (keys, values), (k_new, v_new) in zip(cache, new_kv):
            keys[row, slots] = k_new[i, nodes]
            values[row, slots] = v_new[i, nodes]


def best_first_tree(draft: ToyLM, content, nodes: int, branch: int, window: int | None = None) -> Tree:
    """A draft's tree of up to `nodes` nodes, grown best first: among the top `branch` children of
    the nodes already in the tree, add the one whose path is most likely under the draft (the
    product of the draft's probabilities along it), until `nodes` are in. branch 1 is the draft's
    greedy chain. Logits computed from scratch: slow and obvious."""
    tokens, parent, log_p = [int(content[-1])], [-1], [0.0]
    candidates, order = [], 0  # heap of (-log path probability, order, parent node, token)

    def expand(node: int):
        nonlocal order
        path, at = [], node
        while at > 0:
            path.append(tokens[at])
            at = parent[at]
        logits = draft.logits_of(list(content) + path[::-1], window)[-1]
        shifted = logits - logits.max()
        log_probs = shifted - np.log(np.exp(shifted).sum())
        for token in np.argsort(-logits, kind="stable")[:branch]:
            heapq.heappush(candidates, (-(log_p[node] + log_probs[token]), order, node, int(token)))
            order += 1

    expand(0)
    while len(tokens) - 1 < nodes and candidates:
        cost, _, under, token = heapq.heappop(candidates)
        tokens.append(token)
        parent.append(under)
        log_p.append(-cost)
        expand(len(tokens) - 1)
    return Tree(np.array(tokens), np.array(parent))


def random_tree(rng: np.random.Generator, root: int, nodes: int, vocab: int, likely=None) -> Tree:
    """A random tree of `nodes` draft nodes under root; siblings distinct. likely(path tokens) ->
    a token to prefer (e.g. the target's greedy next token), taken for a node half the time so that
    paths are accepted, not only rejected."""
    tokens, parent = [int(root)], [-1]
    for _ in range(nodes):
        under = int(rng.integers(0, len(tokens)))
        taken = {tokens[j] for j in range(1, len(tokens)) if parent[j] == under}
        path = [tokens[j] for j in [0] + Tree(np.array(tokens), np.array(parent)).path_to(under)]
        wish = likely(path) if likely is not None and rng.random() < 0.5 else int(rng.integers(0, vocab))
        free = [t for t in [wish] + list(rng.permutation(vocab)) if t not in taken]
        if not free:
            continue
        tokens.append(int(free[0]))
        parent.append(under)
    return Tree(np.array(tokens), np.array(parent))


def tree_round(state: RaggedState, cache, rows, target: ToyLM, trees: list[Tree], eos_ids, window, pad_id: int,
               check: bool = False):
    """One greedy tree round over the slot rows `rows` (trees[i] rooted at row i's pending token).
    Commits in place; returns (accepted [R], committed tokens per row, hit_eos [R]).

    With check: I2/I4 of the verify (invariants.check_tree_forward) and I3 of every live row's
    cache after the round (its K/V equal a fresh prefill of content[:-1]); raises InvariantError."""
    accepted, committed, hit_eos, _, found = verify_trees(state, cache, rows, target, trees, eos_ids, window, pad_id,
                                                          check)
    if check:
        found += _check_slot_caches(state, {"target": cache}, _live(state, rows, hit_eos), target, None, window)
        raise_if(found)
    return accepted, committed, hit_eos


def verify_trees(state: RaggedState, cache, rows, target: ToyLM, trees: list[Tree], eos_ids, window, pad_id: int,
                 check: bool = False):
    """tree_round's verify and commit: (accepted [R], committed per row, hit_eos [R], paths, the
    forward's I2/I4 violations when check)."""
    content = state.content_len[rows].copy()
    remaining = state.budget_end[rows] - content
    for i, tree in enumerate(trees):
        if tree.tokens[0] != state.tokens[rows[i], content[i] - 1]:
            raise ValueError(f"row {i}'s tree is not rooted at its pending token")
    logits, new_kv, seen = forward_tree(target, cache, rows, trees, content, window, pad_id)
    choice = logits.argmax(-1)  # [R, Q]: the target's next token after each node
    paths = [greedy_path(tree, choice[i]) for i, tree in enumerate(trees)]
    accepted = np.array([len(p) for p in paths], dtype=np.int64)
    along = np.zeros((len(rows), int(accepted.max(initial=0)) + 1), dtype=np.int64)
    for i, path in enumerate(paths):
        along[i, :len(path) + 1] = choice[i, [0] + path]  # the target's choices on root + path
    n, hit_eos = commit_counts(along, accepted, remaining, eos_ids)
    committed = [along[i, :n[i]].tolist() for i in range(len(rows))]
    keep_path(cache, rows, new_kv, [path[:n[i] - 1] for i, path in enumerate(paths)], content)
    ragged_commit(state, rows, committed)
    found = []
    if check:
        found = check_tree_forward(seen["positions"], seen["allowed"], content, [t.parent for t in trees],
                                   cache[0][0].shape[1], window)
    return accepted, committed, hit_eos, paths, found


def _live(state: RaggedState, rows, hit_eos) -> list:
    """(i, row) of the rows still running after a commit."""
    return [(i, row) for i, row in enumerate(rows)
            if not (hit_eos[i] or state.content_len[row] >= state.budget_end[row])]


def sibling_tokens(logits: np.ndarray, drafted: np.ndarray, count: int) -> np.ndarray:
    """[B, count]: each row's `count` most likely tokens under the draft's step logits [B, V], its
    proposal drafted [B] left out, most likely first (ties: the smaller id first)."""
    out = np.zeros((len(drafted), count), dtype=np.int64)
    for i, row in enumerate(logits):
        ranked = [int(t) for t in np.argsort(-row, kind="stable")[:count + 1] if t != drafted[i]]
        out[i] = ranked[:count]
    return out


def sibling_tree(root: int, drafted, siblings, leaves=None) -> Tree:
    """A row's tree for a round: its proposals as the spine (d_j under node j - 1), then the draft's
    siblings [p, b - 1] of each proposal as leaves under the proposal's parent, step by step (the
    torch engine's numbering, fast.trees); leaves [p]: how many of each step's siblings, the first
    ones (None: all)."""
    drafted, siblings = np.asarray(drafted, dtype=np.int64), np.asarray(siblings, dtype=np.int64)
    p, count = len(drafted), siblings.shape[1] if siblings.ndim == 2 else 0
    leaves = [count] * p if leaves is None else [int(n) for n in leaves[:p]]
    tokens, parent = [root] + drafted.tolist(), list(range(-1, p))
    for step in range(p):
        tokens += siblings[step, :leaves[step]].tolist()
        parent += [step] * leaves[step]
    return Tree(np.array(tokens), np.array(parent))


def ragged_tree_round(state: RaggedState, caches, rows, target: ToyLM, draft: ToyLM, opt, drafted, proposed,
                      step_logits: list, found: list, round_index: int):
    """The verify and commit of a ragged round with tree_branches > 1 (reference.engine.ragged_round
    drafted): each row's proposals and, for each, the draft's next opt.branches - 1 tokens at that
    step as leaves, verified as one tree per row. The draft's cache keeps the K/V of the accepted
    path's leading spine nodes only (its own chain). Returns ragged_round's tuple."""
    content = state.content_len[rows].copy()
    k_round = drafted.shape[1]
    siblings = np.stack([sibling_tokens(step_logits[j], drafted[:, j], opt.branches - 1) for j in range(k_round)],
                        axis=1)  # [B, steps, b - 1]
    trees = [sibling_tree(state.tokens[row, content[i] - 1], drafted[i, :proposed[i]], siblings[i, :proposed[i]])
             for i, row in enumerate(rows)]
    accepted, committed, hit_eos, paths, seen = verify_trees(state, caches["target"], rows, target, trees, opt.eos_ids,
                                                             opt.window, opt.pad_id, opt.check)
    n = np.array([len(c) for c in committed], dtype=np.int64)
    spine = np.array([next((j for j, node in enumerate(path) if node != j + 1), len(path)) for path in paths])
    state.target_pending[rows] = 1
    state.draft_pending[rows] = n - np.minimum(np.minimum(spine, k_round - 1), n)
    if opt.check:
        found = found + seen + _check_slot_caches(state, caches, _live(state, rows, hit_eos), target, draft,
                                                  opt.window)
        raise_if(found, round_index)
    return accepted, n, hit_eos, k_round, proposed


def tree_generate(target: ToyLM, prompts, propose, max_new_tokens, eos_token_id=(), pad_token_id: int = 0,
                  window: int | None = None, check_invariants: bool = False) -> ReferenceResult:
    """Greedy decoding of every prompt in one ragged batch, by tree rounds: propose(content) -> the
    Tree of a row whose content is `content` (rooted at its last token). max_new_tokens: an int or
    one per prompt. Every row's tokens equal greedy_decode's (proofs_notes/trees.md). stats:
    rounds, and per row-round the nodes verified and the accepted length."""
    eos_ids = (eos_token_id,) if np.isscalar(eos_token_id) else tuple(eos_token_id)
    count = len(prompts)
    budgets = [int(max_new_tokens)] * count if np.isscalar(max_new_tokens) else [int(m) for m in max_new_tokens]
    capacity = max(len(p) + b for p, b in zip(prompts, budgets)) + 1
    state = RaggedState.empty(count, capacity)
    cache = [(np.zeros((count, capacity, target.dim)), np.zeros((count, capacity, target.dim)))
             for _ in range(target.n_layers)]
    for row, (prompt, kv) in enumerate(zip(prompts, prefill(target, [p[:-1] for p in prompts], pad_token_id, window))):
        state.tokens[row, :len(prompt)] = prompt
        state.content_len[row], state.prompt_len[row], state.request[row] = len(prompt), len(prompt), row
        state.budget_end[row] = len(prompt) + budgets[row]
        for (keys, values), (k, v) in zip(cache, kv):
            keys[row, :len(prompt) - 1], values[row, :len(prompt) - 1] = k, v
    stop = [None] * count
    stats = dict(rounds=0, nodes=[], accepted=[])
    live = np.array([r for r in range(count) if budgets[r] > 0], dtype=np.int64)
    while len(live):
        trees = [propose(state.content(row)) for row in live]
        accepted, committed, hit_eos = tree_round(state, cache, live, target, trees, eos_ids, window, pad_token_id,
                                                  check_invariants)
        stats["rounds"] += 1
        stats["nodes"] += [t.size - 1 for t in trees]
        stats["accepted"] += accepted.tolist()
        for i, row in enumerate(live):
            if hit_eos[i] or state.content_len[row] >= state.budget_end[row]:
                stop[row] = "eos" if hit_eos[i] else "length"
        live = np.array([row for row in live if stop[row] is None], dtype=np.int64)
    sequences = [state.content(r)[len(p):] for r, p in enumerate(prompts)]
    return ReferenceResult(sequences, [s or "length" for s in stop], stats)
