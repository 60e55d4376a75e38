"""Proposal policies: which rule decides how far each row drafts in a round (fast.proposals).

A policy is asked for the round's rule before drafting (`plan`) and told what the round proposed,
accepted and cost after its verify (`record`), the shape of transformers' CandidateGenerator
(get_candidates / update_candidate_strategy). Three implementations:

    FixedK     every row drafts min(k, remaining - 1) tokens (the threshold rule at threshold 0)
    Threshold  the threshold rule with the run's threshold and floor
    Goodput    the goodput rule, priced each round from costs measured online (proofs_notes/proposals.md)

Goodput chooses each row's proposal length to maximise the expected worth committed per second of
the round. Its model: a verify of N tokens (each row's pending token plus its proposals) takes
verify(N) = a + b N seconds and a draft step over R rows draft(R), both fitted online; the round
also pays the measured overhead outside them. Row i's j-th proposal is accepted, given the earlier
ones were, with probability min(calibration_i * confidence_ij, 1), where calibration_i (accepted
proposals per unit of draft confidence) comes from the row's own history, shrunk towards the batch's
(apart for the rounds it drafts by prompt lookup, whose confidence is always 1).
Before drafting, the best achievable ratio lam = max over plans of (sum of worth committed) / (round
seconds) is found from the rows' history forecasts; a proposal then pays if its expected worth is at
least lam * b (the price of its verify token), a draft step if what it adds is at least lam *
draft(R). With token trees a leaf is priced the same way, one verify token, its acceptance
min(leaf_calibration * runner-up probability, 1) with a leaf calibration pooled over the batch
(accepted leaves per unit of their probabilities, for leaves whose parent was reached; fast.proposals),
learnt apart for the draft model's leaves and a lookup row's (priced by their shares). The worth of a token is 1 while requests wait for a slot; with nobody waiting it is the
row's remaining budget over the largest (the run ends with its longest rows). Greedy and coupled
outputs cannot change with proposal lengths; rejection-sampled outputs with a fixed seed would (the
distribution stays exact), so their default is Threshold.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .costs import History, LinearCost
from .proposals import GoodputRule, ThresholdRule


@dataclass
class PolicySettings:
    """Everything that chooses a policy (make_policy)."""

    kind: str = "goodput"  # "goodput", "threshold" or "fixed"
    k: int = 4  # the most tokens a row drafts in a round
    threshold: float = 0.7  # Threshold: a row stops drafting below this confidence
    floor: float | None = 0.2  # ... and proposes the step it stops at if its confidence is >= floor (None: never)


@dataclass
class RoundInfo:
    """What a policy sees before a round drafts."""

    requests: np.ndarray  # [R] request ids of the round's rows
    clamp: np.ndarray  # [R] min(k, remaining - 1): the most each row may propose
    remaining: np.ndarray | None = None  # [R] tokens left in each row's budget (None: unknown)
    waiting: bool = True  # whether requests wait for a slot


@dataclass
class RoundOutcome:
    """What a round proposed, accepted and cost."""

    requests: np.ndarray  # [R]
    proposed: np.ndarray  # [R] proposals per row
    accepted: np.ndarray  # [R] accepted proposals per row (a prefix; a tree's: its spine nodes on the accepted path)
    confidence: np.ndarray | None  # [R, S] the draft's confidence at each step run (host), or None
    draft_steps: int  # draft model steps run
    draft_seconds: float
    verify_tokens: int  # tokens the verify forward computed
    verify_seconds: float
    lookup_rows: np.ndarray | None = None  # [R] rows that drafted by prompt lookup alone (None: none)
    leaf_confidence: np.ndarray | None = None  # [R] token trees: runner-ups of the leaves whose parent was reached
    leaves_accepted: np.ndarray | None = None  # [R] ... and how many of those leaves were accepted (None: no leaves)
    ended: float = field(default_factory=time.perf_counter)  # clock reading when the round ended


class FixedK:
    reads_confidence = False  # rows never stop on the draft's confidence

    def __init__(self, k: int):
        self.k = k

    def plan(self, info: RoundInfo):
        return ThresholdRule(info.clamp)

    def record(self, outcome: RoundOutcome) -> None:
        pass


class Threshold(FixedK):
    def __init__(self, k: int, threshold: float, floor: float | None):
        super().__init__(k)
        self.threshold, self.floor = threshold, floor
        self.reads_confidence = threshold > 0

    def plan(self, info: RoundInfo):
        return ThresholdRule(info.clamp, self.threshold, self.floor)


def best_ratio(worth, forecast, clamp, base: float, token: float, step: float) -> float:
    """max over proposal plans of (worth committed) / (seconds): each row commits its worth plus
    worth * forecast^j for its j-th proposal; the round costs base + step * (draft steps) + token *
    (proposals). For each number of steps, the proposals enter best first while they raise the ratio."""
    best = float(np.sum(worth)) / base
    depth = np.arange(1, int(np.max(clamp, initial=0)) + 1)
    gain = np.where(depth[None, :] <= clamp[:, None], worth[:, None] * forecast[:, None] ** depth[None, :], 0.0)
    for steps in depth:
        ordered = np.sort(gain[:, :steps].ravel())[::-1]
        count = np.arange(1, len(ordered) + 1)
        best = max(best, float(np.max((np.sum(worth) + np.cumsum(ordered)) / (base + step * steps + token * count))))
    return best


class Goodput:
    """The goodput policy (module docstring)."""

    PRIOR_WEIGHT = 2.0  # pseudo-proposals of the batch's rate in a row's estimate
    LEAF_PRIOR = 1.0  # pseudo-confidence of leaves at the batch's proposal calibration, in the leaf calibrations
    reads_confidence = True

    def __init__(self, k: int):
        self.k = k
        self.verify_cost, self.draft_cost = LinearCost(), LinearCost()
        self.overhead: deque = deque(maxlen=64)  # seconds of a round outside draft and verify
        self.rows: dict = {}  # (request, drafted by lookup) -> History
        self.pooled = {False: History(), True: History()}  # the batch's, by source
        self.leaves = {False: History(), True: History()}  # token trees: the batch's reached leaves (their
        # runner-up probabilities, a lookup row's their shares) and accepted ones, by source
        self.last_record = None
        self.rule = None

    def estimates(self, requests, lookup: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(forecast, calibration) [R]: each row's acceptance per proposal and per unit of
        confidence, from its own history shrunk towards the batch's, for proposals of the draft
        model or (lookup=True) of rows that draft by prompt lookup, whose confidence is always 1."""
        w, pooled = self.PRIOR_WEIGHT, self.pooled[lookup]
        pooled_rate = (pooled.accepted + w * 0.5) / (pooled.reached + w)
        pooled_confidence = (pooled.confidence + w * 0.5) / (pooled.reached + w)
        own = [self.rows.get((int(r), lookup), History()) for r in requests]
        accepted = np.array([h.accepted for h in own]) + w * pooled_rate
        forecast = accepted / (np.array([h.reached for h in own]) + w)
        calibration = accepted / (np.array([h.confidence for h in own]) + w * pooled_confidence)
        return forecast, calibration

    def leaf_calibration(self, rows: int, lookup: bool = False) -> np.ndarray:
        """[R]: accepted leaves per unit of their runner-up probabilities, the batch's, shrunk towards
        the batch's calibration of proposals from the same source: the draft model's, or (lookup=True)
        the prompt lookup's, whose leaves are priced by their shares of the n-gram's occurrences."""
        pooled, leaves = self.pooled[lookup], self.leaves[lookup]
        prior = (pooled.accepted + self.PRIOR_WEIGHT * 0.5) / (pooled.confidence + self.PRIOR_WEIGHT * 0.5)
        value = (leaves.accepted + self.LEAF_PRIOR * prior) / (leaves.confidence + self.LEAF_PRIOR)
        return np.full(rows, value)

    def worth(self, info: RoundInfo) -> np.ndarray:
        rows = len(info.clamp)
        if info.waiting or info.remaining is None:
            return np.ones(rows)
        remaining = np.asarray(info.remaining, dtype=float)
        return remaining / max(remaining.max(), 1.0)

    def plan(self, info: RoundInfo):
        clamp = np.asarray(info.clamp, dtype=np.int64)
        rows = len(clamp)
        forecast, calibration = self.estimates(info.requests)
        by_lookup = self.estimates(info.requests, lookup=True)[1]
        worth = self.worth(info)
        leaf_calibration = self.leaf_calibration(rows), self.leaf_calibration(rows, lookup=True)
        if not (self.draft_cost.measured() and self.verify_cost.measured()):  # the first round: everything
            self.rule = GoodputRule(clamp, worth, calibration, forecast, 0.0, 0.0, by_lookup, *leaf_calibration)
            return self.rule
        overhead = float(np.median(self.overhead)) if self.overhead else 0.0
        token, step = self.verify_cost.slope(), self.draft_cost(rows)  # one verify token: a proposal's, a leaf's
        lam = best_ratio(worth, forecast, clamp, max(self.verify_cost(rows) + overhead, 1e-9), token, step)
        self.rule = GoodputRule(clamp, worth, calibration, forecast, lam * token, lam * step, by_lookup,
                                *leaf_calibration)
        return self.rule

    def record(self, outcome: RoundOutcome) -> None:
        rows = len(outcome.proposed)
        if outcome.draft_steps:
            self.draft_cost.add(rows, outcome.draft_seconds / outcome.draft_steps)
        self.verify_cost.add(outcome.verify_tokens, outcome.verify_seconds)
        now = outcome.ended
        if self.last_record is not None:  # commit, bookkeeping, refills: paid once a round
            self.overhead.append(max(now - self.last_record - outcome.draft_seconds - outcome.verify_seconds, 0.0))
        self.last_record = now
        proposed, accepted = np.asarray(outcome.proposed), np.asarray(outcome.accepted)
        reached = np.minimum(accepted + 1, proposed)  # proposals whose earlier ones were all accepted
        confidence = np.zeros(rows)
        if outcome.confidence is not None and outcome.confidence.size:
            columns = np.arange(outcome.confidence.shape[1])[None, :] < reached[:, None]
            confidence = np.where(columns, outcome.confidence, 0.0).sum(axis=1)
        landed = np.minimum(accepted, proposed)
        lookup = np.zeros(rows, dtype=bool) if outcome.lookup_rows is None else np.asarray(outcome.lookup_rows)
        for source in (False, True):  # evidence of both sources ages every round
            mine = lookup == source
            if outcome.leaf_confidence is not None:
                self.leaves[source].add(0.0, float(outcome.leaves_accepted[mine].sum()),
                                        float(outcome.leaf_confidence[mine].sum()))
            self.pooled[source].add(float(reached[mine].sum()), float(landed[mine].sum()),
                                    float(confidence[mine].sum()))
            for i, r in enumerate(outcome.requests):
                self.rows.setdefault((int(r), source), History()).add(
                    float(reached[i] * mine[i]), float(landed[i] * mine[i]), float(confidence[i] * mine[i]))


def make_policy(settings: PolicySettings):
    """The policy the settings name (None where k is 0: nothing is drafted)."""
    if not settings.k:
        return None
    if settings.kind == "goodput":
        return Goodput(settings.k)
    if settings.kind == "threshold":
        return Threshold(settings.k, settings.threshold, settings.floor)
    if settings.kind == "fixed":
        return FixedK(settings.k)
    raise ValueError(f"unknown proposal policy {settings.kind!r} (goodput, threshold or fixed)")
