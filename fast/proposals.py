"""How far each row drafts in a round: the per-row proposal rules (proofs_notes/proposals.md).

A rule is applied step by step while drafting (engine.draft_round) and again, on the whole round,
by the checkers (I7). Row i proposes its (j+1)-th token at draft step j only if it proposed every
earlier one and j < limit_i = min(k, remaining_i - 1); what else it needs is the rule's:

    ThresholdRule  confidence_ij' >= threshold at every earlier step j' < j, and confidence_ij >= floor
    GoodputRule    worth_i * prod_{j' <= j} min(calibration_i * confidence_ij', 1) >= bar

confidence_ij is the probability of the most likely token of the row's (processed) draft
distribution at step j: a function of the row's own visible content and the draft, never of the
token drawn and never of another row. The goodput rule's per-row numbers come from the row's own
history and its budget, its bar from the round's measured costs (fast.policy.Goodput), so a row's
length never follows a neighbour's tokens. A rule may also stop drafting for every model row at
once (the goodput rule, where one more draft step does not pay); it then lowers those rows' limits
to the proposals they have, so the checkers see the same limit. A row that proposes nothing gets
exactly one target token; a round in which no row proposes is a plain target step.

With token trees (fast.trees) a rule also decides how many leaves each proposal's step brings
(`leaves`), of the candidates the step has (`available`: tree_branches - 1 on a model row; on a
lookup row, the other followers its lookup found, none in rejection mode): the threshold rule all
of them, the goodput rule the leading ones whose expected worth pays for their verify token, from
the step's runner-up probabilities (the 2nd, 3rd, ... largest of the draft's distribution; a lookup
row's: each follower's share of the n-gram's occurrences; like `confidence`, never a token drawn):

    leaf r at step j:  worth_i * prod_{j' < j} min(calibration_i * confidence_ij', 1)
                       * min(leaf_calibration_i * runner_up_ijr, 1) >= bar

A leaf commits one more token exactly when the target's choice is its token (siblings are
distinct), so its expected gain has the same form as a proposal's; the verify token is the same
price. Where no leaf pays the row's tree is its chain.
"""
from __future__ import annotations

import numpy as np


def proposal_lengths(confidence: np.ndarray, limit: np.ndarray, threshold: float, floor: float | None = None
                     ) -> np.ndarray:
    """The threshold rule's p_i from the row's confidences at each draft step [R, S] and its limit
    [R]: the leading steps at or above the threshold, then the step that stopped the row if it is at
    or above the floor (None: floor = threshold, never)."""
    confidence = np.asarray(confidence, dtype=float).reshape(len(limit), -1)
    passed = np.pad(confidence >= threshold, ((0, 0), (1, 0)), constant_values=True)[:, :-1]
    reached = passed.cumprod(axis=1).astype(bool)  # every step before j passed the threshold
    steps = np.arange(confidence.shape[1])[None, :] < np.asarray(limit)[:, None]
    proposes = reached & (confidence >= (threshold if floor is None else floor)) & steps
    return proposes.cumprod(axis=1).sum(axis=1)  # and proposed at every earlier step


def goodput_lengths(confidence: np.ndarray, limit: np.ndarray, worth: np.ndarray, calibration: np.ndarray,
                    bar: float) -> np.ndarray:
    """The goodput rule's p_i from the row's confidences [R, S], limit, worth and calibration [R]."""
    confidence = np.asarray(confidence, dtype=float).reshape(len(limit), -1)
    accept = np.minimum(np.asarray(calibration, dtype=float)[:, None] * confidence, 1.0)
    value = np.asarray(worth, dtype=float)[:, None] * np.cumprod(accept, axis=1)
    steps = np.arange(confidence.shape[1])[None, :] < np.asarray(limit)[:, None]
    return ((value >= bar) & steps).cumprod(axis=1).sum(axis=1)


def goodput_leaves(runner_ups: np.ndarray, reach: np.ndarray, worth, leaf_calibration, bar: float) -> np.ndarray:
    """[R]: the goodput rule's leaves at one step, from the step's runner-up probabilities [R, b - 1]
    (most likely first) and each row's reach before the step [R]: the leading ones that pay."""
    accept = np.minimum(np.asarray(leaf_calibration, dtype=float)[:, None] * runner_ups, 1.0)
    value = (np.asarray(worth, dtype=float) * reach)[:, None] * accept
    return (value >= bar).cumprod(axis=1).sum(axis=1)


class ThresholdRule:
    """The threshold rule; threshold 0 is fixed k (every row drafts its whole limit, no confidences
    read). Every proposal brings every candidate its step has (`available`: b - 1 on a model row)."""

    decides_leaves = False  # leaves need no runner-up probabilities

    def __init__(self, limit: np.ndarray, threshold: float = 0.0, floor: float | None = None):
        self.limit = np.asarray(limit, dtype=np.int64).copy()
        self.threshold = float(threshold)
        self.floor = self.threshold if floor is None else float(floor)
        self.needs_confidence = self.threshold > 0
        self.model_rows = np.ones(len(self.limit), dtype=bool)

    def begin(self, model_rows: np.ndarray) -> np.ndarray:
        """The rows that draft at step 0."""
        self.model_rows = np.asarray(model_rows, dtype=bool)
        return self.limit > 0

    def leaves(self, j: int, runner_ups, proposes: np.ndarray, available: np.ndarray) -> np.ndarray:
        """[R] leaves under step j's proposal: every candidate the step has (available [R])."""
        return np.where(proposes, available, 0)

    def check_leaves(self, leaves, runner_ups, confidence, proposed, available) -> list:
        from ..invariants import check_threshold_leaves
        return check_threshold_leaves(leaves, proposed, available)

    def step(self, j: int, confidence, active: np.ndarray):
        """(proposes, goes_on) [R] at step j from the step's confidences (host float64, or None). A row
        is active at step j only if it went on from step j - 1 (begin: limit > 0), so j < limit."""
        if not self.needs_confidence:
            return active, active & (j + 1 < self.limit)
        return active & (confidence >= self.floor), active & (confidence >= self.threshold) & (j + 1 < self.limit)

    def check(self, proposed, confidence) -> list:
        from ..invariants import check_proposal_lengths
        return check_proposal_lengths(proposed, confidence, self.limit, self.threshold, self.floor)

    def fields(self, i: int) -> dict:
        return dict(floor=self.floor)


class GoodputRule:
    """The goodput rule: a row proposes a token while its expected committed worth pays for the
    verify token at the round's price `bar`; one more draft step runs while what the next proposals
    of the model rows are expected to add pays for the step at `step_price` (fast.policy.Goodput)."""

    needs_confidence = True

    decides_leaves = True  # from the runner-up probabilities of each step (module docstring)

    def __init__(self, limit, worth, calibration, forecast, bar: float, step_price: float, lookup_calibration=None,
                 leaf_calibration=None, lookup_leaf_calibration=None):
        self.limit = np.asarray(limit, dtype=np.int64).copy()
        self.worth, self.calibration, self.forecast = worth, calibration, forecast  # [R] each
        self.lookup_calibration = calibration if lookup_calibration is None else lookup_calibration  # [R]
        self.leaf_calibration = calibration if leaf_calibration is None else leaf_calibration  # [R]
        self.lookup_leaf_calibration = self.leaf_calibration if lookup_leaf_calibration is None \
            else lookup_leaf_calibration  # [R]
        self.bar, self.step_price = float(bar), float(step_price)
        self.reach = np.ones(len(self.limit))  # P(every proposal so far is accepted), per row
        self.reach_before = self.reach  # the same before the current step: what its leaves need to be reached
        self.model_rows = np.ones(len(self.limit), dtype=bool)

    def _pays(self, gain: np.ndarray, going: np.ndarray) -> bool:
        return float(np.maximum(gain - self.bar, 0.0)[going & self.model_rows].sum()) >= self.step_price

    def begin(self, model_rows: np.ndarray) -> np.ndarray:
        """The first model step runs only if the rows' forecasts pay for it (lookup rows need none);
        a lookup row's calibrations are its lookup proposals' (their confidence is always 1) and its
        lookup leaves' (priced by their shares)."""
        self.model_rows = np.asarray(model_rows, dtype=bool)
        self.calibration = np.where(self.model_rows, self.calibration, self.lookup_calibration)
        self.leaf_calibration = np.where(self.model_rows, self.leaf_calibration, self.lookup_leaf_calibration)
        active = self.limit > 0
        if not self._pays(self.worth * self.forecast, active):
            self.limit[self.model_rows] = 0
            active &= ~self.model_rows
        return active

    def step(self, j: int, confidence, active: np.ndarray):
        accept = np.minimum(self.calibration * confidence, 1.0)
        self.reach_before, self.reach = self.reach, self.reach * accept
        value = self.worth * self.reach
        proposes = active & (j < self.limit) & (value >= self.bar)
        goes_on = proposes & (j + 1 < self.limit)
        if not self._pays(value * accept, goes_on):  # the next step's proposals would not pay for it
            cut = goes_on & self.model_rows
            self.limit[cut] = j + 1
            goes_on &= ~cut
        return proposes, goes_on

    def leaves(self, j: int, runner_ups, proposes: np.ndarray, available: np.ndarray) -> np.ndarray:
        """[R] leaves under step j's proposal: the leading runner-ups [R, b - 1] (host float64) that pay,
        of the candidates the step has (available [R])."""
        count = goodput_leaves(runner_ups, self.reach_before, self.worth, self.leaf_calibration, self.bar)
        return np.where(proposes, np.minimum(count, available), 0)

    def check(self, proposed, confidence) -> list:
        from ..invariants import check_goodput_lengths
        return check_goodput_lengths(proposed, confidence, self.limit, self.worth, self.calibration, self.bar)

    def check_leaves(self, leaves, runner_ups, confidence, proposed, available) -> list:
        from ..invariants import check_goodput_leaves
        return check_goodput_leaves(leaves, runner_ups, confidence, proposed, available, self.worth,
                                    self.calibration, self.leaf_calibration, self.bar)

    def fields(self, i: int) -> dict:
        return dict(worth=float(self.worth[i]), calibration=float(self.calibration[i]), bar=self.bar)
