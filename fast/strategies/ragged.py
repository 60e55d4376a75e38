"""Ragged (ours): per-row lengths, no padding, no realignment, continuous refill.

Each batch slot owns a buffer row in both models' SlotCache; content index j of a row lives in slot
j with position j. A round drafts and verifies exactly as EQSPEC does, but every row writes its new
K/V at its own offsets and the commit only writes token ids and adds to content_len: no cache data
moves. A finished row frees its slot at once; the next queued request takes it and is prefilled
in one forward before the next round (reference.pool.SlotQueue is the scheduler, shared with the
reference). See proofs_notes/ragged.md. The engine holds the target's side; the draft's side (its
slot cache, pending tokens, proposals) is a proposer (fast.proposer). A draft that reads the target's
features (fast.drafts.feature_draft) runs only here: each slot row also keeps the target's features of its
content (proofs_notes/feature_drafts.md).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from ...invariants import check_conservation, check_mask, check_positions, check_tree_forward
from ...reference.pool import SlotQueue
from ..compute.attention import flat_plan, uses_engine_attention
from ..drafts.feature_draft import FeatureCapture
from ..layout import TreeLayout, VerifyLayout
from ..engine import Arrivals, Proposals, Settings, Stats, check_cache_row, rect_queries, record_round
from ..compute.prefill import prefill_into
from ..proposer import proposer_for
from ..compute.slot_cache import SlotCache
from ..compute.slot_forward import slot_forward, storage_dtype
from ..processors import STOP, STOP_REASONS
from ..trees import SiblingTrees, keep_accepted_path, rejection_walk, verify_tree
from ..verify import commit_counts


def flat_queries(plan, rows: int) -> list:
    """Per row, the position ids and visible slots of its verify queries in a flat forward (host)."""
    out = [None] * rows
    for part in plan:
        members = np.arange(rows)[part.rows] if isinstance(part.rows, slice) else part.rows.cpu().numpy()
        visible = (part.mask[:, 0] == 0).cpu().numpy()
        for r, row in enumerate(members):
            real = part.query_index[r] >= 0
            out[row] = (part.query_index[r][real], visible[r][real])
    return out


@dataclass
class Verdict:
    """What one verify decided, per row (host arrays, but choice)."""

    choice: torch.Tensor  # [R, W] the tokens after the root and each accepted node: row i commits choice[i, :n_i]
    accepted: np.ndarray  # [R] accepted proposals (a tree's: the accepted path's length)
    n: np.ndarray  # [R] committed tokens
    hit_eos: np.ndarray  # [R] why the row stopped this round (processors.STOP_REASONS; 0: it did not)
    queries: Callable  # () -> per row, the position ids and visible slots of its queries (the observer's)
    verified: int  # queries the target's forward computed
    nodes: int  # proposals and tree nodes verified (the roots not counted)
    draft_accepted: np.ndarray  # [R] leading accepted proposals from the draft's own chain (its K/V stay valid)
    tree: Callable | None = None  # () -> (parents, node tokens [R, W], node choices [R, W] or None, path [R, P])


class RaggedEngine:
    def __init__(self, target, draft, prompts, max_new, settings: Settings, stats: Stats, clock, slots: int):
        self.target, self.settings, self.stats, self.clock = target, settings, stats, clock
        self.prompts, self.max_new, self.slots = prompts, max_new, slots
        # the longest content, then the scratch slots of a round's tree (chains: its k + 1 queries)
        capacity = max(len(p) + m for p, m in zip(prompts, max_new)) + settings.k * settings.tree_branches + 1
        self.capacity = capacity
        dev = settings.device
        self.tokens = torch.zeros(slots, capacity + 1, dtype=torch.long, device=dev)
        self.request = np.full(slots, -1)
        self.content_len = np.zeros(slots, dtype=np.int64)
        self.prompt_len = np.zeros(slots, dtype=np.int64)
        self.budget_end = np.zeros(slots, dtype=np.int64)
        self.rounds = np.zeros(slots, dtype=np.int64)  # rounds the slot's request has run
        self.cache = SlotCache(target.num_layers, slots, capacity, dev, storage_dtype(target, settings))
        self.proposer = proposer_for(draft, settings, self.tokens, slots, capacity)  # the draft's side (fast.proposer)
        self.queue = SlotQueue(slots)
        # the target runs the engine's attention (which groups rows by length): needed by the flat verify
        self.grouped = uses_engine_attention(target.model)
        # a target that attends to nothing (fast.drafts.scripted.ImposedLM) needs no masks to verify a tree
        if settings.tree_branches > 1 and not (self.grouped or getattr(target.model, "attends", True) is False):
            raise ValueError(f"tree_branches={settings.tree_branches} needs the flat verify, which the target's "
                             f"attention ({type(target.model).__name__}) does not run; use tree_branches=1")
        self.arrivals = settings.arrivals or Arrivals(len(prompts))
        # a feature draft (fast.drafts.feature_draft) reads the target's features of each row's content
        self.capture = None
        if self.proposer.features is not None:
            self.capture = FeatureCapture(target.model, self.proposer.features)

    def admit(self) -> None:
        """Prefill newly placed requests into their slots, in one forward per model."""
        for r in self.arrivals.due():
            self.queue.submit(r)
        placed = self.queue.refill()
        if not placed:
            return
        slots = np.array([slot for slot, _ in placed])
        requests = [r for _, r in placed]
        lens = np.array([len(self.prompts[r]) for r in requests])
        width = int(lens.max())
        dev = self.settings.device
        prompts = [list(self.prompts[r]) for r in requests]
        self.tokens[torch.as_tensor(slots, device=dev), :width] = torch.tensor(
            [p + [0] * (width - len(p)) for p in prompts], device=dev)  # content j in column j
        self.request[slots], self.content_len[slots], self.prompt_len[slots] = requests, lens, lens
        self.budget_end[slots] = lens + np.array([self.max_new[r] for r in requests])
        self.rounds[slots] = 0
        with self.clock("time_prefill"):  # everything but each prompt's pending last token, packed
            route = self.capture.route if self.capture is not None else None  # the target's features, for the draft
            prefill_into(self.target, self.cache, [p[:-1] for p in prompts], slots.tolist(), [0] * len(prompts),
                         self.settings, route)
            self.proposer.prefill(prompts, slots)
        self.settings.observer.end_round(0)

    def compact(self) -> None:
        """Keep the running rows in slots 0..R-1 (SlotQueue.compact): a hole left by a finished row
        that no waiting request filled takes the highest running row (one row of cache copied)."""
        for src, dst in self.queue.compact():
            count = int(self.content_len[src])
            self.tokens[dst, :count] = self.tokens[src, :count]
            for array in (self.request, self.content_len, self.prompt_len, self.budget_end, self.rounds):
                array[dst] = array[src]
            self.request[src] = -1
            for side in (self.cache, self.proposer):
                side.move_row(src, dst, count)

    def round(self, round_index: int, on_done) -> None:
        """One round over the running rows (slots 0..R-1): draft each row's proposals, verify them
        all in one target forward, commit each row's tokens at its own offset (nothing moves)."""
        s = self.settings
        rows = np.nonzero(self.request >= 0)[0]
        assert len(rows) and rows[-1] == len(rows) - 1, "running rows must be slots 0..R-1 (compact)"
        self.rounds[rows] += 1
        self.last_round = dict(slots=rows.tolist(), queued=len(self.queue.queue))
        content = self.content_len[rows]  # [R] c_i: content before this round's commit
        remaining = self.budget_end[rows] - content  # [R] tokens each row may still commit
        with self.clock("time_draft"):
            proposals = self.propose(rows, content, remaining)
        with self.clock("time_verify"):
            verdict = self.verify(rows, content, remaining, proposals)
        record_round(s, self.clock, self.request[rows], proposals, verdict.accepted, verdict.verified,
                     verdict.draft_accepted)
        with self.clock("time_align"):
            self.commit(rows, content, remaining, proposals, verdict, round_index, on_done)
        self.stats.add_round(proposals.proposed, verdict.accepted, verdict.n, verdict.nodes, verdict.draft_accepted)
        s.observer.check(lambda: check_conservation(range(self.arrivals.released), self.queue.members())
                         + self._check_caches(round_index))
        s.observer.end_round(round_index)

    def propose(self, rows, content, remaining) -> Proposals:
        """Each row's proposals from the proposer (fast.proposer; engine.draft_round applies the policy)."""
        requests = torch.as_tensor(self.request[rows], device=self.settings.device)
        waiting = bool(self.queue.queue) or self.arrivals.pending()
        proposals = self.proposer.propose(rows, content, remaining, requests, waiting)
        self.stats.lookup_rounds += bool(proposals.steps and not proposals.model_steps)
        return proposals

    def verify(self, rows, content, remaining, proposals: Proposals) -> "Verdict":
        """The target's verdict on each row's proposals (a tree's, fast.trees, with tree_branches > 1
        where the proposal rule gave any row a leaf; a round of chains is verified as chains): the
        tokens each row commits and how many, in one target forward."""
        s = self.settings
        rows_dev = torch.as_tensor(rows, device=s.device)
        dev = lambda a: torch.as_tensor(a, device=s.device)  # noqa: E731
        requests, content_t, p = dev(self.request[rows]), dev(content), proposals.proposed
        width = proposals.width
        drafted = proposals.drafted[:, :width - 1]
        q = None if proposals.q is None else proposals.q[:, :width - 1]
        last = self.tokens[rows_dev, dev(content - 1)]
        tokens = torch.cat([last[:, None], drafted], dim=1)  # [R, W]: row i uses its first p_i + 1
        spine, tree, nodes = None, None, int(p.sum())
        if proposals.siblings is not None and proposals.leaves.any():  # one flat forward of each row's tree
            choice, accepted_t, spine, queries, verified, tree = self.verify_tree(rows, last, content, proposals)
            nodes = verified - len(rows)
        elif self.grouped:  # one flat forward of each row's own proposals
            choice, accepted_t, queries, verified = self.verify_flat(tokens, content, p, drafted, q, requests,
                                                                     content_t)
        else:
            query_index = content[:, None] - 1 + np.arange(width)[None, :]
            if self.capture is not None:  # features of every verified position (rejected ones are never read)
                self.capture.route(rows_dev[:, None].expand(-1, width), dev(query_index))
            logits, pos, mask = slot_forward(self.target, self.cache, query_index, tokens, s, self.grouped)
            choice, accepted_t = s.chooser.verify(logits, drafted, q, dev(p), requests, content_t)
            queries, verified = (lambda: rect_queries(pos, mask, p)), tokens.numel()
        n_t, hit_t = commit_counts(choice, accepted_t, dev(remaining), s.eos)
        counts = [accepted_t, n_t, hit_t.long()] + ([] if spine is None else [spine])
        host = torch.stack(counts).cpu().numpy()  # one sync a round
        accepted, n, hit_eos = host[:3]
        if s.processors is not None:  # stop strings, and the history penalties count
            n, hit_eos = s.processors.finish_round(requests, choice, n, hit_eos)
        return Verdict(choice, accepted, n, hit_eos, queries, verified, nodes,
                       accepted if spine is None else host[3], tree)

    def verify_tree(self, rows, last, content, proposals: Proposals):
        """One target forward over every row's tree (fast.trees.SiblingTrees: its chain, and the leaves
        the proposal rule chose); the chooser's choice (greedy or coupled) after every node.
        Returns (choice [R, P + 1] along root + accepted path, accepted [R], spine_accepted [R],
        queries, verified, tree) with the path's K/V already in the row's content slots (I3)."""
        s = self.settings
        dev = lambda a: torch.as_tensor(a, device=s.device)  # noqa: E731
        trees = SiblingTrees.of(proposals.proposed, s.tree_branches, content, proposals.leaves)
        layout = trees.layout
        candidates = trees.candidates(last, proposals.drafted, proposals.siblings)  # [R, 1 + P * b]
        node_tokens = candidates.gather(1, dev(trees.source))  # [R, W]
        plan = flat_plan(layout.token_row, layout.token_index, s.window, s.dtype, s.fill, s.device, layout.position,
                         layout.ancestors)
        ids = node_tokens[dev(layout.token_row), dev(layout.column)][None]
        pos = dev(layout.position)[None]
        # every node's features at its scratch slot (the accepted path's move with its K/V)
        logits = self._flat_forward(layout, ids, pos, plan, dev(layout.token_index)[None])  # [N, V]
        node_requests = dev(self.request[rows][layout.token_row])  # [N]
        if s.chooser.needs_q:  # rejection: each node's candidates tested in turn against its residual
            p_nodes = s.chooser.log_probs(logits, node_requests).exp()[dev(layout.gather)]  # [R, W, V]
            node_choice = None
            choice, accepted, spine, path = rejection_walk(trees, p_nodes, node_tokens, proposals.q,
                                                           s.chooser.keys(dev(self.request[rows])), dev(content))
        else:  # greedy, coupled: the target's choice after every node, and the walk along it
            node_choice = s.chooser.tree_choices(logits, dev(layout.gather), node_requests, pos[0] + 1)  # [R, W]
            choice, accepted, spine, path = verify_tree(trees, node_choice, node_tokens)
        kept = [self.cache] + ([self.proposer.features] if self.capture is not None else [])
        keep_accepted_path(kept, dev(rows), path, dev(content))
        s.observer.check(lambda: self._check_tree(plan, layout, pos, len(content)))
        tree = lambda: (trees.parents, node_tokens.cpu().numpy(),  # noqa: E731
                        None if node_choice is None else node_choice.cpu().numpy(), path.cpu().numpy())
        return choice, accepted, spine, (lambda: flat_queries(plan, len(content))), layout.tokens, tree

    def commit(self, rows, content, remaining, proposals: Proposals, verdict: "Verdict", round_index: int,
               on_done) -> None:
        """Write the target's choices at each row's own offset and add n_i to its content (no cache
        data moves but a tree's accepted path, moved in verify_tree); release the rows that finished."""
        s = self.settings
        rows_dev = torch.as_tensor(rows, device=s.device)
        choice, n, hit_eos = verdict.choice, verdict.n, verdict.hit_eos
        columns = torch.as_tensor(content[:, None] + np.arange(choice.shape[1])[None, :], device=s.device)
        self.tokens[rows_dev[:, None], columns] = choice
        finished = (hit_eos > 0) | (n == remaining)
        s.observer.round(s, round_index, lambda: dict(
            requests=self.request[rows], prompt_len=self.prompt_len[rows], tokens=self._contents(rows, content),
            pad_len=np.zeros(len(rows)), content_len=content), verdict.queries, proposals, choice, verdict.accepted,
            n, remaining, finished, hit_eos == STOP, tree=verdict.tree)
        self.content_len[rows] = content + n
        self.proposer.update(rows, n, verdict.draft_accepted, proposals)
        self._release(rows[finished], hit_eos[finished], on_done)

    def verify_flat(self, tokens, content, proposed, drafted, q, requests, content_t):
        """One target forward over every row's own queries laid end to end (fast.layout.VerifyLayout):
        row i's pending token and its p_i proposals, at content indices c_i - 1 .. c_i - 1 + p_i."""
        s = self.settings
        layout = VerifyLayout.of(proposed, content)
        plan = flat_plan(layout.token_row, layout.token_index, s.window, s.dtype, s.fill, s.device)
        dev = lambda a: torch.as_tensor(a, device=s.device)  # noqa: E731
        ids = tokens[dev(layout.token_row), dev(layout.column)][None]
        pos = dev(layout.token_index)[None]
        logits = self._flat_forward(layout, ids, pos, plan, pos)  # features of every verified position
        choice, accepted = s.chooser.verify_flat(logits, dev(layout.gather), drafted, q, dev(proposed), requests,
                                                 content_t)
        s.observer.check(lambda: self._check_flat(plan, layout, pos, len(proposed)))
        return choice, accepted, (lambda: flat_queries(plan, len(proposed))), layout.tokens

    def _flat_forward(self, layout, ids, pos, plan, feature_index) -> torch.Tensor:
        """The target's logits [N, V] of one flat forward over a layout's queries (VerifyLayout or
        TreeLayout): query t's K/V go to slot layout.token_index[t] of its row, a feature draft's
        features to feature_index; the plan's masks decide what each query sees."""
        s = self.settings
        dev = lambda a: torch.as_tensor(a, device=s.device)  # noqa: E731
        self.cache.prepare_flat(dev(layout.token_row), dev(layout.token_index), len(layout.content),
                                int(layout.token_index.max()) + 1)
        if self.capture is not None:  # rejected positions' features are never read
            self.capture.route(dev(layout.token_row)[None], feature_index)
        hidden = torch.full((1, 1, 1, 1), s.fill, dtype=s.dtype, device=s.device).expand(1, 1, layout.tokens,
                                                                                         self.cache.kv_len)
        return self.target(ids, pos, hidden, self.cache, flat=plan)[0]

    def _check_flat(self, plan, layout: VerifyLayout, pos, rows: int) -> list:
        """I2, I4 of a flat verify against what the lengths alone say row r's query j must be: c_r - 1 + j."""
        found = []
        for part in plan:
            members = np.arange(rows)[part.rows] if isinstance(part.rows, slice) else part.rows.cpu().numpy()
            want = layout.query_index(members, part.query_index.shape[1])
            got = pos[0][part.tokens].view(want.shape).cpu().numpy()
            slot = np.broadcast_to(np.arange(part.length), (len(members), part.length))
            found += check_positions(got, want) + check_mask(part.mask, want, slot, self.settings.window)
        return found

    def _check_tree(self, plan, layout: TreeLayout, pos, rows: int) -> list:
        """I2, I4 of a tree verify (invariants.check_tree_forward): each part's mask over the row's
        slots, the tree's scratch slots c - 1 .. c - 2 + size read as its nodes, against the parents."""
        found = []
        position = pos[0].cpu().numpy()
        for part in plan:
            members = np.arange(rows)[part.rows] if isinstance(part.rows, slice) else part.rows.cpu().numpy()
            allowed = (part.mask[:, 0] == 0).cpu().numpy()  # [M, Q, length]
            for m, row in enumerate(members):
                size, root = int(layout.size[row]), int(layout.content[row]) - 1
                seen = np.zeros((1, size, part.length + size), dtype=bool)
                seen[0, :, :part.length] = allowed[m, :size]
                seen[0, :, root:root + size] = False  # the nodes' scratch slots are read as nodes
                seen[0, :, part.length:] = allowed[m, :size, root:root + size]
                start = int(layout.start[row])
                parents = layout.parent[row, :size]
                violations = check_tree_forward(position[None, start:start + size], seen, [root + 1], [parents],
                                                part.length, self.settings.window)
                found += [replace(v, row=int(row)) for v in violations]
        return found

    def _contents(self, rows, content):
        """Row contents as a right-padded tensor (for the trace only)."""
        width = int(content.max())
        return self.tokens[torch.as_tensor(rows, device=self.settings.device), :width]

    def _release(self, rows, hit_eos, on_done) -> None:
        if len(rows) == 0:
            return
        host = self.tokens[torch.as_tensor(rows, device=self.settings.device)].cpu().numpy()
        for j, slot in enumerate(rows):
            on_done(int(self.request[slot]), host[j, self.prompt_len[slot]:self.content_len[slot]].tolist(),
                    STOP_REASONS[int(hit_eos[j])], int(self.rounds[slot]))
            self.queue.release(int(slot))
            self.request[slot] = -1

    def _check_caches(self, round_index):
        """I3 on one sampled row per round (round robin): slots 0.. hold a fresh prefill's K/V (the
        target's of the content but its pending last token; the draft's, fast.proposer)."""
        rows = np.nonzero(self.request >= 0)[0]
        if len(rows) == 0:
            return []
        row = int(rows[round_index % len(rows)])
        content = self.tokens[row, :self.content_len[row]].tolist()
        prefix = content[:-1]
        found = check_cache_row(self.target, lambda layer: self.cache.slot_values(layer, row, len(prefix)), row,
                                prefix, 0, self.settings, "target cache")
        return found + self.proposer.check_cache(row, content)

    def run(self, on_done) -> None:
        round_index = 0
        try:
            while self.arrivals.pending() or self.queue.queue or (self.request >= 0).any():
                for r in self.arrivals.due():
                    self.queue.submit(r)
                if not self.queue.queue and not (self.request >= 0).any():
                    self.arrivals.wait()
                    continue
                round_index += 1
                self.step(round_index, on_done)
        finally:
            self.close()

    def close(self) -> None:
        """Give the caches' buffers back for the next generation (fast.compute.slot_cache.SPARES) and
        remove the feature hook from the target (a feature draft's engine only)."""
        self.cache.release()
        self.proposer.release()
        if self.capture is not None:
            self.capture.close()

    def step(self, round_index: int, on_done) -> bool:
        """Admit what arrived into free slots, compact, and run one round if any row is running."""
        self.admit()
        self.compact()
        if not (self.request >= 0).any():
            return False
        self.round(round_index, on_done)
        return True


class Ragged:
    """RAGGED: rows in slots with per-row offsets, one flat verify, a freed slot refilled at once."""
    layout = "ragged"
    keeps_features = True
    verifies_trees = True  # tree_branches > 1 (fast.trees)

    def __init__(self, options=None):
        pass

    def run(self, target, draft, prompts, max_new, settings: Settings, stats: Stats, clock, batch_size: int, on_done):
        slots = min(batch_size, len(prompts))  # more slots than requests would only hold memory
        RaggedEngine(target, draft, prompts, max_new, settings, stats, clock, slots).run(on_done)
