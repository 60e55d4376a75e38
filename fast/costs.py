"""What the goodput policy measures online (fast.policy.Goodput): seconds as a line in a size, and
a row's acceptance history."""
from __future__ import annotations

from collections import deque

import numpy as np


class LinearCost:
    """seconds = a + b * x, fitted by weighted least squares through the median of the last
    `per_size` observations at each x. Medians, so that one round slowed down by the machine does
    not move the fit; with one x seen, the line goes through the origin and that point."""

    def __init__(self, per_size: int = 16):
        self.samples: dict = {}
        self.per_size, self.fit = per_size, None

    def add(self, x: float, seconds: float) -> None:
        self.samples.setdefault(float(x), deque(maxlen=self.per_size)).append(float(seconds))
        self.fit = None

    def measured(self) -> bool:
        return bool(self.samples)

    def __call__(self, x: float) -> float:
        if self.fit is None:
            xs = np.array(list(self.samples))
            ys = np.array([np.median(v) for v in self.samples.values()])
            weight = np.array([len(v) for v in self.samples.values()], dtype=float)
            if len(xs) < 2:
                self.fit = (0.0, float(ys[0] / xs[0]))
            else:
                b = max(float(np.polyfit(xs, ys, 1, w=np.sqrt(weight))[0]), 0.0)
                self.fit = (max(float(np.average(ys - b * xs, weights=weight)), 0.0), b)
        a, b = self.fit
        return a + b * x

    def slope(self) -> float:
        self(0.0)
        return self.fit[1]


class History:
    """Proposals that were reached (every earlier one accepted), accepted, and the draft confidence
    summed over the reached ones; evidence ages by DECAY a round."""

    DECAY = 0.9

    def __init__(self):
        self.reached = self.accepted = self.confidence = 0.0

    def add(self, reached: float, accepted: float, confidence: float) -> None:
        self.reached = self.reached * self.DECAY + reached
        self.accepted = self.accepted * self.DECAY + accepted
        self.confidence = self.confidence * self.DECAY + confidence
