"""How far each row drafts in a round: its proposal length p_i, 0..k.

The rule (proofs_notes/proposals.md), evaluated step by step while drafting:

    limit_i = min(k, remaining_i - 1, cap)        budget clamp, and the round's cap
    row i proposes its (j+1)-th token at draft step j  <=>  it proposed at every earlier step,
        j < limit_i, and confidence_ij >= threshold

where confidence_ij is the probability of the most likely token of the row's (processed) draft
distribution at step j: a function of the row's own visible content and the draft, never of the
token drawn and never of another row. A row that proposes nothing gets exactly one target token;
a round in which no row proposes is a plain target step; the verify covers each row's own
proposals only (a flat forward in the ragged layout; in rectangular layouts the longer rows' width,
whose extra columns the shorter rows never accept: their limit is their own p_i).

`cap` is k unless the cost-aware controller (DraftController, adaptive=True) lowers it for the
round: it fits the measured seconds of draft steps and verify forwards to the batch size and the
number of verified tokens, estimates each row's chance to propose and to be accepted from the row's
own history, and picks the cap with the most expected committed tokens per second, 0 (a plain
target step) included. The cap depends on the batch and the machine: greedy and coupled outputs
cannot change (any proposal is verified), but rejection-sampled outputs with a fixed seed would,
so adaptive defaults to off there (their distribution is exact either way).
"""
from __future__ import annotations

from collections import deque

import numpy as np

DEFAULT_THRESHOLD = 0.3


def proposal_lengths(confidence: np.ndarray, limit: np.ndarray, threshold: float) -> np.ndarray:
    """p_i from the row's confidences at each draft step [R, S] and its limit [R] (the rule above,
    as one function; the engines apply it step by step and the checkers recompute it with this)."""
    confidence = np.asarray(confidence, dtype=float).reshape(len(limit), -1)
    passing = confidence >= threshold
    steps = np.arange(confidence.shape[1])[None, :] < np.asarray(limit)[:, None]
    return (passing & steps).cumprod(axis=1).sum(axis=1)


class LinearCost:
    """seconds = a + b * x, least squares over the last `window` observations (x: tokens or rows)."""

    def __init__(self, window: int = 64):
        self.points: deque = deque(maxlen=window)

    def add(self, x: float, seconds: float) -> None:
        self.points.append((float(x), float(seconds)))

    def ready(self) -> bool:
        return len({x for x, _ in self.points}) >= 2

    def __call__(self, x: float) -> float:
        xs, ys = np.array(self.points).T
        if len(set(xs)) < 2:  # one size seen: proportional through that point's mean
            return float(ys.mean() * x / xs.mean())
        b, a = np.polyfit(xs, ys, 1)
        b = max(b, 0.0)
        a = max(float(ys.mean() - b * xs.mean()), 0.0)
        return a + b * x


class RowHistory:
    """Counts behind a row's chance to propose another token and to have it accepted."""

    def __init__(self):
        self.proposed = self.stopped = self.accepted = self.rejected = 0

    def rates(self, prior: "RowHistory | None" = None, weight: float = 2.0) -> tuple[float, float]:
        """(g, a): P(propose at a step it reaches), P(accepted | proposed, earlier ones accepted),
        shrunk towards the prior's rates (the batch's pooled history) with `weight` pseudo-counts."""
        pg, pa = prior.rates(None) if prior is not None else (0.5, 0.5)
        g = (self.proposed + weight * pg) / (self.proposed + self.stopped + weight)
        a = (self.accepted + weight * pa) / (self.accepted + self.rejected + weight)
        return g, a


class DraftController:
    """Chooses the round's cap (0..k) from measured costs and each row's history (module doc)."""

    def __init__(self, k: int, adaptive: bool):
        self.k, self.adaptive = k, adaptive
        self.verify_cost, self.draft_cost = LinearCost(), LinearCost()
        self.rows: dict = {}
        self.pooled = RowHistory()
        self.rounds = 0
        self.caps: list = []

    def cap(self, requests, limit: np.ndarray) -> int:
        """The largest proposal length allowed this round (limit: each row's min(k, remaining - 1))."""
        self.rounds += 1
        if not self.adaptive or self.k == 0 or not limit.max():
            cap = int(limit.max()) if self.k else 0
        elif self.rounds == 1 or not self.draft_cost.points:
            cap = self.k  # explore: the first rounds measure a full draft and a plain target step
        elif not self.verify_cost.ready():
            cap = 0
        else:
            cap = self.best_cap([self.rows.get(int(r), RowHistory()) for r in requests], limit)
        self.caps.append(cap)
        return cap

    def best_cap(self, histories, limit: np.ndarray) -> int:
        rows = len(histories)
        rates = [h.rates(self.pooled) for h in histories]
        best, best_rate = 0, rows / max(self.verify_cost(rows), 1e-9)
        for cap in range(1, self.k + 1):
            tokens = verified = 0.0
            for (g, a), lim in zip(rates, limit):
                steps = np.arange(1, min(cap, int(lim)) + 1)
                tokens += 1 + float(((g * a) ** steps).sum())
                verified += 1 + float((g ** steps).sum())
            seconds = cap * self.draft_cost(rows) + self.verify_cost(verified)
            if seconds > 0 and tokens / seconds > best_rate:
                best, best_rate = cap, tokens / seconds
        return best

    def record(self, requests, proposed, accepted, reached_limit, rows: int, draft_steps: int, draft_seconds: float,
               verify_tokens: int, verify_seconds: float) -> None:
        """One round's outcome: per row its proposal length, accepted drafts and whether it stopped
        at its limit (True) or on its confidence (False); the measured seconds."""
        if draft_steps:
            self.draft_cost.add(rows, draft_seconds / draft_steps)
        self.verify_cost.add(verify_tokens, verify_seconds)
        if not draft_steps:
            return
        for r, p, acc, at_limit in zip(requests, proposed, accepted, reached_limit):
            for h in (self.rows.setdefault(int(r), RowHistory()), self.pooled):
                h.proposed += int(p)
                h.stopped += int(not at_limit)
                h.accepted += int(acc)
                h.rejected += int(acc < p)

    def forget(self, request: int) -> None:
        self.rows.pop(int(request), None)
