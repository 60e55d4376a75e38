"""Ragged (ours): per-row lengths, no padding, no realignment, continuous refill.

Each batch slot owns a buffer row in both models' SlotCache; content index j of a row lives in slot
j with position j. A round drafts and verifies exactly as EQSPEC does, but every row writes its new
K/V at its own offsets and the commit only writes token ids and adds to content_len: no cache data
moves. A finished row frees its slot at once; the next queued request takes it and is prefilled
in one forward before the next round (reference.pool.SlotQueue is the scheduler, shared with the
reference). See proofs_notes/ragged.md.
"""
from __future__ import annotations

import numpy as np
import torch

from ...invariants import check_conservation, check_mask, check_positions
from ...reference.pool import SlotQueue
from ..engine import Arrivals, Settings, Stats, check_cache_row, observe_round, raise_violations
from ..prefill import prefill_into
from ..slot_cache import SlotCache
from ..verify import commit_counts, draft_pending_after


def ragged_inputs(query_index: torch.Tensor, kv_len: int, window: int | None, dtype, fill: float):
    """Position ids [R, Q] and the 4D mask [R, 1, Q, kv_len]: query q sees slots 0..q (I2, I4)."""
    slot = torch.arange(kv_len, device=query_index.device)[None, None, :]
    q = query_index[:, :, None]
    visible = slot <= q
    if window is not None:
        visible &= slot > q - window
    mask = torch.zeros(visible.shape, dtype=dtype, device=query_index.device).masked_fill_(~visible, fill)
    return query_index.clamp(min=0), mask[:, None]


def storage_dtype(runner, settings: Settings):
    """float32 K/V for a half-precision model on a CPU whose attention is ours (the small attention
    products are several times faster in float32 there); otherwise the model's own dtype."""
    from ..attention import uses_engine_attention
    half = settings.dtype in (torch.bfloat16, torch.float16) and settings.device.type == "cpu"
    return torch.float32 if half and uses_engine_attention(runner.model) else None


class RaggedEngine:
    def __init__(self, target, draft, prompts, max_new, settings: Settings, stats: Stats, clock, slots: int):
        self.target, self.draft, self.settings, self.stats, self.clock = target, draft, settings, stats, clock
        self.prompts, self.max_new, self.slots = prompts, max_new, slots
        capacity = max(len(p) + m for p, m in zip(prompts, max_new)) + settings.k + 1
        self.capacity = capacity
        dev = settings.device
        self.tokens = torch.zeros(slots, capacity + 1, dtype=torch.long, device=dev)
        self.request = np.full(slots, -1)
        self.content_len = np.zeros(slots, dtype=np.int64)
        self.prompt_len = np.zeros(slots, dtype=np.int64)
        self.budget_end = np.zeros(slots, dtype=np.int64)
        self.draft_pending = np.ones(slots, dtype=np.int64)
        self.rounds = np.zeros(slots, dtype=np.int64)  # rounds the slot's request has run
        self.caches = {name: SlotCache(runner.num_layers, slots, capacity, dev, storage_dtype(runner, settings))
                       for name, runner in (("target", target), ("draft", draft)) if runner is not None}
        self.queue = SlotQueue(slots)
        self.arrivals = settings.arrivals or Arrivals(len(prompts))

    def forward(self, name, query_index: np.ndarray, ids, found, last_only=False):
        """One forward of `name` over the running slot rows 0..R-1 with per-row query indices."""
        s = self.settings
        cache = self.caches[name]
        q = torch.as_tensor(query_index, device=s.device)
        cache.prepare(len(query_index), q, int(query_index.max()) + 1)  # host numpy: no device sync
        pos, mask = ragged_inputs(q, cache.kv_len, s.window, s.dtype, s.fill)
        if s.check:
            slot = np.broadcast_to(np.arange(cache.kv_len), (len(query_index), cache.kv_len))
            found += check_positions(pos, query_index) + check_mask(mask, query_index, slot, s.window)
        runner = self.target if name == "target" else self.draft
        kv_lens = query_index.max(axis=1) + 1  # each row's visible length: attention reads no further
        return runner(ids, pos, mask, cache, last_only=last_only, kv_lens=kv_lens), pos, mask

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
        self.draft_pending[slots], self.rounds[slots] = 1, 0
        found = [] if self.settings.check else None
        with self.clock("time_prefill"):  # everything but each prompt's pending last token, packed
            for name, runner in (("target", self.target), ("draft", self.draft)):
                if runner is not None:
                    prefill_into(runner, self.caches[name], [p[:-1] for p in prompts], slots.tolist(),
                                 [0] * len(prompts), self.settings, found)
        if found:
            raise_violations(found, 0)

    def compact(self) -> None:
        """Keep the running rows in slots 0..R-1 (SlotQueue.compact): a hole left by a finished row
        that no waiting request filled takes the highest running row (one row of cache copied)."""
        for src, dst in self.queue.compact():
            count = int(self.content_len[src])
            self.tokens[dst, :count] = self.tokens[src, :count]
            for array in (self.request, self.content_len, self.prompt_len, self.budget_end, self.draft_pending,
                          self.rounds):
                array[dst] = array[src]
            self.request[src] = -1
            for cache in self.caches.values():
                cache.move_row(src, dst, count)

    def round(self, round_index: int, on_done) -> None:
        s = self.settings
        rows = np.nonzero(self.request >= 0)[0]
        assert len(rows) and rows[-1] == len(rows) - 1, "running rows must be slots 0..R-1 (compact)"
        self.rounds[rows] += 1
        self.last_round = dict(slots=rows.tolist(), queued=len(self.queue.queue))
        content = self.content_len[rows]
        remaining = self.budget_end[rows] - content
        limit = np.minimum(s.k, remaining - 1) if self.draft is not None else np.zeros(len(rows), dtype=np.int64)
        k = int(limit.max())
        found: list = []
        rows_dev = torch.as_tensor(rows, device=s.device)

        dev = lambda a: torch.as_tensor(a, device=s.device)  # noqa: E731
        requests, content_t = dev(self.request[rows]), dev(content)
        drafted, q = self.tokens.new_empty((len(rows), 0)), None
        if k:
            with self.clock("time_draft"):
                pending = int(self.draft_pending[rows].max())
                query_index = content[:, None] - pending + np.arange(pending)[None, :]
                ids = self.tokens[rows_dev[:, None], torch.as_tensor(np.maximum(query_index, 0), device=s.device)]
                steps, dists = [], []
                for step in range(k):
                    logits, _, _ = self.forward("draft", query_index, ids, found, last_only=True)
                    token, dist = s.chooser.draft(logits[:, -1], requests, content_t + step)
                    ids = token[:, None]
                    steps.append(ids)
                    dists.append(dist)
                    query_index = content[:, None] + step
                drafted = torch.cat(steps, dim=1)
                q = torch.stack(dists, dim=1) if s.chooser.needs_q else None

        with self.clock("time_verify"):
            query_index = content[:, None] - 1 + np.arange(k + 1)[None, :]
            last = self.tokens[rows_dev, torch.as_tensor(content - 1, device=s.device)]
            ids = torch.cat([last[:, None], drafted], dim=1)
            logits, pos, mask = self.forward("target", query_index, ids, found)
            choice, accepted_t = s.chooser.verify(logits, drafted, q, dev(limit), requests, content_t)
            n_t, hit_t = commit_counts(choice, accepted_t, dev(remaining), s.eos)
            accepted, n, hit_eos = torch.stack([accepted_t, n_t, hit_t.long()]).cpu().numpy()

        with self.clock("time_align"):
            # the commit: write the target's choices at each row's own offset; nothing else moves
            columns = dev(content[:, None] + np.arange(k + 1)[None, :])
            self.tokens[rows_dev[:, None], columns] = choice
            finished = (hit_eos == 1) | (n == remaining)
            observe_round(s, found, round_index, dict(
                requests=self.request[rows], prompt_len=self.prompt_len[rows], tokens=self._contents(rows, content),
                pad_len=np.zeros(len(rows)), content_len=content),
                pos, mask, drafted, choice, limit, accepted, n, remaining, finished)
            self.content_len[rows] = content + n
            self.draft_pending[rows] = draft_pending_after(n, accepted, k, self.draft_pending[rows])
            self._release(rows[finished], hit_eos[finished], on_done)
        self.stats.add_round(k, accepted, n)
        if s.check:
            found += check_conservation(range(self.arrivals.released), self.queue.members())
            found += self._check_caches(round_index)
            raise_violations(found, round_index)

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
                    "eos" if hit_eos[j] else "length", int(self.rounds[slot]))
            self.queue.release(int(slot))
            self.request[slot] = -1

    def _check_caches(self, round_index):
        """I3 on one sampled row per round (round robin): slots 0.. hold a fresh prefill's K/V."""
        rows = np.nonzero(self.request >= 0)[0]
        if len(rows) == 0:
            return []
        row = int(rows[round_index % len(rows)])
        content = self.tokens[row, :self.content_len[row]].tolist()
        found = []
        for name, runner, pending in (("target", self.target, 1), ("draft", self.draft, self.draft_pending[row])):
            if runner is not None:
                cache, prefix = self.caches[name], content[:len(content) - int(pending)]
                found += check_cache_row(runner, lambda layer: cache.slot_values(layer, row, len(prefix)), row,
                                         prefix, 0, self.settings, f"{name} cache")
        return found

    def run(self, on_done) -> None:
        round_index = 0
        while self.arrivals.pending() or self.queue.queue or (self.request >= 0).any():
            for r in self.arrivals.due():
                self.queue.submit(r)
            if not self.queue.queue and not (self.request >= 0).any():
                self.arrivals.wait()
                continue
            round_index += 1
            self.step(round_index, on_done)

    def step(self, round_index: int, on_done) -> bool:
        """Admit what arrived into free slots, compact, and run one round if any row is running."""
        self.admit()
        self.compact()
        if not (self.request >= 0).any():
            return False
        self.round(round_index, on_done)
        return True


def run(target, draft, prompts, max_new, settings: Settings, stats: Stats, clock, batch_size: int, on_done):
    RaggedEngine(target, draft, prompts, max_new, settings, stats, clock, batch_size).run(on_done)
