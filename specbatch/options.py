"""One source of strategies, defaults and argument checks.

The API (`specbatch.generate`), the CLI, the bench and the NumPy reference all take their strategy
list and defaults from here, and the API and the CLI judge numbers with the same checks, so both
give the same verdict naming the same argument. Pure Python: the reference imports it without torch.
"""
from __future__ import annotations

import math
import numbers

STRATEGIES = ("eqspec", "exspec", "ragged")  # the public strategies (the broken variants are bench-only)

DEFAULTS = dict(
    strategy="ragged",  # per-row offsets, no realignment, continuous refill
    num_draft_tokens=4,  # k: the most tokens a row proposes in a round
    batch_size=8,
    max_new_tokens=128,
    draft_threshold=0.7,  # a row stops proposing below this draft confidence (docs/draft_eval: calibration)
    draft_floor=0.2,  # ... but still proposes the token it stopped at if its confidence is at least this
    max_wait=4,  # exspec: rounds a row may wait for a same-length group
    seed=0,
)

SEED_LIMIT = 2**63  # seeds are int64 keys of the counter-based generator (fast.rng)


class OptionError(ValueError):
    """An argument out of its range; the message starts with the argument's name."""


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(name: str, value, low: int = 1, high: int | None = None) -> int:
    """An integer in [low, high] (high None: unbounded)."""
    if not _is_int(value) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise OptionError(f"{name} must be an integer {span}, got {value!r}")
    return int(value)


def check_real(name: str, value, low: float, high: float = math.inf, low_open: bool = False) -> float:
    """A finite number in [low, high] ((low, high] when low_open); NaN and infinities are refused."""
    if not _is_real(value) or not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        left = "(" if low_open else "["
        right = "]" if math.isfinite(high) else ")"
        raise OptionError(f"{name} must be a finite number in {left}{low}, {high}{right}, got {value!r}")
    return float(value)


def check_temperature(value) -> float:
    return check_real("temperature", value, 0.0)


def check_top_p(value) -> float:
    return check_real("top_p", value, 0.0, 1.0, low_open=True)


def check_top_k(value) -> int:
    return check_int("top_k", value)


def check_probability(name: str, value) -> float:
    return check_real(name, value, 0.0, 1.0)


def check_seed(value, count: int | None = None):
    """An integer seed in [0, 2^63), or (count given) one per prompt."""
    if isinstance(value, (list, tuple)):
        if count is not None and len(value) != count:
            raise OptionError(f"seed has {len(value)} entries for {count} prompts")
        return [check_int("seed", v, 0, SEED_LIMIT - 1) for v in value]
    return check_int("seed", value, 0, SEED_LIMIT - 1)


def check_arrival_rate(value) -> float:
    return check_real("arrival_rate", value, 0.0, low_open=True)


def check_arrivals(values, count: int) -> list[float]:
    """One finite, non-negative, nondecreasing arrival time (seconds) per prompt."""
    values = list(values)
    if len(values) != count:
        raise OptionError(f"arrivals must give one time per prompt: {len(values)} times for {count} prompts")
    for i, v in enumerate(values):
        check_real(f"arrivals[{i}]", v, 0.0)
        if i and v < values[i - 1]:
            raise OptionError(f"arrivals must be nondecreasing: arrivals[{i}] = {v} < arrivals[{i - 1}] = "
                              f"{values[i - 1]}")
    return [float(v) for v in values]


def check_token_id(name: str, value, vocab: int) -> int:
    """A token id: an integer (not a float, a string or a bool) in [0, vocab)."""
    if not _is_int(value) or not 0 <= value < vocab:
        raise OptionError(f"{name} must be an integer token id in [0, {vocab}), got {value!r}")
    return int(value)


def check_token_ids(name: str, value, vocab: int) -> tuple[int, ...]:
    """One token id or a list of them (empty: none; a string is refused, not read character by character)."""
    if isinstance(value, (list, tuple)):
        return tuple(check_token_id(name, v, vocab) for v in value)
    return (check_token_id(name, value, vocab),)
