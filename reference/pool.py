"""Scheduling as plain state machines: EQSPEC's fixed batches, the EXSPEC sequence pool and the
ragged slot queue. The torch engine uses these same classes, so the reference states exactly the
scheduling the fast engine runs (tests/test_scheduling.py checks their properties against
independent statements, and the fast engine's traces against them).

EQSPEC (FixedBatches): requests form batches of up to `batch_size` in arrival order; a batch runs
until its last row finishes (finished rows leave at once, no zombie rows) and only then does the
next batch start. No refill: that is EQSPEC's published design, which realigns one fixed batch.

Every request is in exactly one of: queue (not prefilled), pool (prefilled, idle between rounds),
running (in this round's batch) and done (S1). Both schedulers are FIFO at heart, which gives S3.

EXSPEC batch selection, in order:
1. Overdue rows first: rows that have waited `max_wait` rounds in the window are taken, longest
   waiting first, and the batch is filled with the oldest other rows. A row waits at most
   max_wait + ceil(window / batch_size) rounds (S3).
2. Otherwise group the window by key (content_len, target_pending, draft_pending). The largest
   group (ties: the one holding the oldest row) runs alone if it has at least
   `ceil(min_group_fraction * batch)` rows, and at least 2 (a lone row is not worth a round of its
   own): same key means equal length, so no realignment (δ = 0).
3. Otherwise fall back to the oldest rows of the window, which need realignment.
A partial group runs a smaller batch but moves no data; below the fraction, batch capacity is
worth more than the saved realignment, hence the threshold (0.5 by default).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class FixedBatches:
    """EQSPEC's scheduler: fixed batches in arrival order, the next one only when the last is empty."""

    batch_size: int
    queue: list = field(default_factory=list)
    running: list = field(default_factory=list)
    done: list = field(default_factory=list)

    def submit(self, request: int) -> None:
        self.queue.append(request)

    def next_batch(self) -> list[int]:
        """The next batch (the oldest queued requests), or [] while a batch still runs."""
        if self.running:
            return []
        self.running, self.queue = self.queue[:self.batch_size], self.queue[self.batch_size:]
        return list(self.running)

    def finish(self, finished) -> None:
        """Rows of the running batch that finished this round leave it."""
        finished = set(finished)
        self.done += [r for r in self.running if r in finished]
        self.running = [r for r in self.running if r not in finished]

    def members(self) -> dict:
        return {"queue": list(self.queue), "running": list(self.running), "done": list(self.done)}


@dataclass
class PoolRow:
    request: int
    key: tuple  # (content_len, target_pending, draft_pending)
    waited: int = 0


@dataclass
class ExspecPool:
    batch_size: int
    window: int
    max_wait: int = 4
    min_group_fraction: float = 0.5
    queue: list = field(default_factory=list)  # request ids, arrival order
    pool: list = field(default_factory=list)  # PoolRow, seniority order
    running: list = field(default_factory=list)
    done: list = field(default_factory=list)
    arrival: dict = field(default_factory=dict)  # request -> arrival number (seniority)

    def submit(self, request: int) -> None:
        self.arrival[request] = len(self.arrival)
        self.queue.append(request)

    def admit(self) -> list[int]:
        """Requests to prefill now: enough to fill the window. The caller adds them with `enter`."""
        free = self.window - len(self.pool) - len(self.running)
        admitted, self.queue = self.queue[:max(free, 0)], self.queue[max(free, 0):]
        return admitted

    def enter(self, request: int, key: tuple) -> None:
        self.pool.append(PoolRow(request, key))

    def select(self) -> tuple[list[int], bool]:
        """Choose this round's batch from the window. Returns (request ids, grouped)."""
        window = self.pool[: self.window]
        size = min(self.batch_size, len(window))
        if size == 0:
            return [], False
        overdue = sorted((r for r in window if r.waited >= self.max_wait), key=lambda r: -r.waited)
        if overdue:  # longest-waiting first (stable: oldest first among equals)
            chosen = (overdue + [r for r in window if r.waited < self.max_wait])[:size]
        else:
            groups: dict = {}
            for r in window:
                groups.setdefault(r.key, []).append(r)
            best = max(groups.values(), key=len)  # max keeps the first (oldest) among equals
            if len(best) >= max(min(2, size), math.ceil(self.min_group_fraction * size)):
                chosen = best[:size]
            else:
                chosen = window[:size]
        grouped = len({r.key for r in chosen}) == 1
        chosen_ids = {r.request for r in chosen}
        for r in window:
            r.waited = 0 if r.request in chosen_ids else r.waited + 1
        self.running = [r for r in self.pool if r.request in chosen_ids]
        self.pool = [r for r in self.pool if r.request not in chosen_ids]
        return [r.request for r in self.running], grouped

    def finish_round(self, keys: dict, finished: set) -> None:
        """Return the running rows to the pool with their new keys, or to done. Kept rows go back
        in their seniority order, so a row never loses its place by running."""
        back = [PoolRow(r.request, keys[r.request], 0) for r in self.running if r.request not in finished]
        self.done += [r.request for r in self.running if r.request in finished]
        self.running = []
        self.pool = sorted(self.pool + back, key=lambda r: self.arrival[r.request])

    def members(self) -> dict:
        return {"queue": list(self.queue), "pool": [r.request for r in self.pool],
                "running": [r.request for r in self.running], "done": list(self.done)}


@dataclass
class SlotQueue:
    """The ragged layout's scheduler: fixed slots, FIFO queue, a finished row frees its slot, queued
    requests take free slots lowest first, and `compact` keeps the running rows in slots 0..R-1."""

    slots: int
    queue: list = field(default_factory=list)
    owner: list = field(default_factory=list)  # request per slot, -1 when free
    done: list = field(default_factory=list)

    def __post_init__(self):
        self.owner = [-1] * self.slots

    def submit(self, request: int) -> None:
        self.queue.append(request)

    def refill(self) -> list[tuple[int, int]]:
        """Give free slots to queued requests in arrival order; returns (slot, request) pairs."""
        placed = []
        for slot in range(self.slots):
            if self.owner[slot] < 0 and self.queue:
                self.owner[slot] = self.queue.pop(0)
                placed.append((slot, self.owner[slot]))
        return placed

    def release(self, slot: int) -> None:
        self.done.append(self.owner[slot])
        self.owner[slot] = -1

    def compact(self) -> list[tuple[int, int]]:
        """Move requests from the highest occupied slots into the lowest free ones until the
        occupied slots are exactly 0..R-1; returns the moves (from_slot, to_slot) in order.

        The engine calls it after refilling, so a hole is filled by a move only when no request
        was waiting for it; the running rows then always form the prefix of the slot buffers."""
        moves = []
        while True:
            free = [s for s in range(self.slots) if self.owner[s] < 0]
            used = [s for s in range(self.slots) if self.owner[s] >= 0]
            if not free or not used or free[0] > used[-1]:
                return moves
            src, dst = used[-1], free[0]
            self.owner[dst], self.owner[src] = self.owner[src], -1
            moves.append((src, dst))

    def members(self) -> dict:
        return {"queue": list(self.queue), "pool": [], "running": [r for r in self.owner if r >= 0],
                "done": list(self.done)}
