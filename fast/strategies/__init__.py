"""The strategies: where a batch's rows live between rounds. One class per strategy, named in a registry.

A strategy class is built from the run's `GenerateOptions` and has one method,

    run(target, draft, prompts, max_new, settings, stats, clock, batch_size, on_done) -> None

which decodes every request to the end and calls on_done(request, tokens, stop_reason, rounds)
once per request (S1-S3). Two class attributes tell the API what it needs to know:
`layout` ("rectangular" or "ragged": the round trace's layout, invariants.trace) and
`keeps_features` (whether it carries a feature draft's target features between rounds).

`STRATEGIES` maps each public name to its class; `reference.STRATEGIES` holds the NumPy twin of
each (a test keeps the two name sets equal). The API, options and the CLI's choices read the names
from here, so a new strategy is one module here, one in reference/, and one line in each registry.
`BROKEN` holds the deliberately wrong variants, which only `api.generate_variant` runs.
"""
from __future__ import annotations

from typing import Protocol

from .broken import BspLike, DsdLike
from .eqspec import Eqspec
from .exspec import Exspec
from .ragged import Ragged


class Strategy(Protocol):
    layout: str  # "rectangular" or "ragged"
    keeps_features: bool

    def __init__(self, options) -> None: ...

    def run(self, target, draft, prompts, max_new, settings, stats, clock, batch_size: int, on_done) -> None: ...


STRATEGIES: dict[str, type[Strategy]] = {"eqspec": Eqspec, "exspec": Exspec, "ragged": Ragged}
BROKEN: dict[str, type[Strategy]] = {"bsp-like": BspLike, "dsd-like": DsdLike}


def register(name: str, strategy: type[Strategy]) -> None:
    """Add a strategy under `name` (its reference twin goes in reference.STRATEGIES under the same name)."""
    if name in STRATEGIES or name in BROKEN:
        raise ValueError(f"a strategy named {name!r} is already registered")
    STRATEGIES[name] = strategy
