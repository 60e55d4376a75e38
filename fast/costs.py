"""What the goodput policy measures online (fast.policy.Goodput): seconds as a line in a size, and
a row's acceptance history."""
from __future__ import annotations

from collections import deque

import numpy as np


def nonnegative_line(xs, ys, weight) -> tuple[float, float]:
    """(a, b) minimising sum weight * (a + b x - y)^2 subject to a >= 0 and b >= 0: costs neither
    start below zero nor fall with size. Where the unconstrained line breaks a bound, the best line on
    that bound (through the origin, or flat): a line through two nearby sizes can be steep and far
    below zero at the origin, and clipping its intercept without refitting would price every other
    size far too high. One size seen: the line through the origin and that point."""
    xs, ys, weight = (np.asarray(v, dtype=float) for v in (xs, ys, weight))
    if len(xs) >= 2:
        b, a = np.polyfit(xs, ys, 1, w=np.sqrt(weight))
        if a >= 0 and b >= 0:
            return float(a), float(b)
    origin = (0.0, max(float(np.sum(weight * xs * ys) / np.sum(weight * xs * xs)), 0.0) if np.any(xs) else 0.0)
    if len(xs) < 2:
        return origin
    flat = (max(float(np.average(ys, weights=weight)), 0.0), 0.0)
    return min((origin, flat), key=lambda line: float(np.sum(weight * (line[0] + line[1] * xs - ys) ** 2)))


class LinearCost:
    """seconds = a + b * x, a >= 0 and b >= 0, fitted by weighted least squares (nonnegative_line)
    through the median of the last `per_size` observations at each x. Medians, so that one round
    slowed down by the machine does not move the fit."""

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
            self.fit = nonnegative_line(xs, ys, weight)
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
