"""The two test profiles (tests/conftest.py selects one).

default (`pytest`): every strategy, invariant, sampling mode and draft kind at small sizes; each
parameter grid runs a pairwise covering subset (every pair of values of any two parameters appears
in some case), Hypothesis runs the "quick" profile, and tests marked `full` are deselected.
full (`pytest --full`): every case of every grid, the tests marked `full`, Hypothesis's "full" profile.
"""
import itertools

import pytest
from hypothesis import settings

REFERENCE_EXAMPLES = 40  # examples(n) gives n examples at this max_examples


def examples(n: int) -> int:
    """Examples for a slow property: n scaled by the loaded profile's max_examples relative to 40
    (quick 10: n / 4; full 60: 1.5 n; HYPOTHESIS_PROFILE=thorough, 400: 10 n), at least 2."""
    return max(2, n * settings.default.max_examples // REFERENCE_EXAMPLES)


def pairwise(cases: list[tuple]) -> set[tuple]:
    """A small subset of `cases` (tuples of equal length) that holds every pair of values at any two
    positions that some case holds: greedy, taking in order the case that covers the most pairs not
    yet covered (deterministic: ties go to the earliest case)."""
    def pairs(case):
        return {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(case)), 2)}
    uncovered = set().union(*(pairs(c) for c in cases)) if cases else set()
    chosen: set = set()
    while uncovered:
        best = max(cases, key=lambda c: len(pairs(c) & uncovered))
        chosen.add(best)
        uncovered -= pairs(best)
    return chosen


def grid(**axes) -> list:
    """pytest.param cases of the product of `axes` (name -> values, in id order): the pairwise subset
    runs in the default profile, every other case is marked `full`. Use as
    @pytest.mark.parametrize("a,b", grid(a=[...], b=[...]))."""
    cases = list(itertools.product(*axes.values()))
    quick = pairwise(cases) if len(axes) > 1 else set(cases)
    return [pytest.param(*c, id="-".join(map(str, c)), marks=() if c in quick else pytest.mark.full) for c in cases]


def only_full(*values):
    """Parametrize values of which only the first runs in the default profile."""
    return [v if i == 0 else pytest.param(v, marks=pytest.mark.full) for i, v in enumerate(values)]
