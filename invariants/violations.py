"""Structured invariant violations: what broke, where, what was expected and what was seen."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import SpecbatchError


def as_numpy(x) -> np.ndarray:
    """NumPy view of an array-like or a torch tensor (without importing torch)."""
    if hasattr(x, "detach"):
        x = x.detach()
        if str(getattr(x, "dtype", "")) == "torch.bfloat16":
            x = x.float()
        x = x.cpu().numpy()
    return np.asarray(x)


@dataclass(frozen=True)
class Violation:
    invariant: str  # "I1".."I6", "S1".."S4"
    message: str
    row: int | None = None  # batch row (or request id where rows do not apply)
    index: int | None = None  # content index, column or slot, as the message says
    expected: Any = None
    actual: Any = None
    round: int | None = None

    def at_round(self, round_: int) -> "Violation":
        return replace(self, round=round_)

    def __str__(self) -> str:
        where = [f"{name} {value}" for name, value in (("round", self.round), ("row", self.row), ("index", self.index))
                 if value is not None]
        text = f"{self.invariant} violated"
        if where:
            text += " (" + ", ".join(where) + ")"
        text += f": {self.message}"
        if self.expected is not None or self.actual is not None:
            text += f"; expected {self.expected!r}, got {self.actual!r}"
        return text


class InvariantError(SpecbatchError):
    """Raised by engines running with check_invariants=True; carries the violations found."""

    def __init__(self, violations: list[Violation]):
        self.violations = list(violations)
        first = self.violations[0]
        more = f" (and {len(self.violations) - 1} more)" if len(self.violations) > 1 else ""
        super().__init__(str(first) + more)

    @property
    def invariant(self) -> str:
        return self.violations[0].invariant


def raise_if(violations: list[Violation], round_: int | None = None) -> None:
    if violations:
        if round_ is not None:
            violations = [v.at_round(round_) for v in violations]
        raise InvariantError(violations)
