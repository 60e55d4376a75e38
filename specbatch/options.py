"""Every default of a generation run in one object, and the argument checks.

`GenerateOptions` holds the defaults. `defaults()` returns the instance in force (`DEFAULTS`),
which the API (`specbatch.generate`), the CLI (its flags and help text are generated from the
fields below), `bench`, `demo` and the NumPy reference read when they are called, so a default
changed here changes all of them. The API and the CLI judge numbers with the same checks, so both
give the same verdict naming the same argument. Pure Python: the reference imports it without torch.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import sys
from dataclasses import dataclass, field

from .errors import SpecbatchError

SAMPLING_MODES = ("rejection", "coupled")
DTYPES = ("float32", "float64", "bfloat16", "float16")
SEED_LIMIT = 2**63  # seeds are int64 keys of the counter-based generator (fast.rng)


def _option(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class GenerateOptions:
    """How a run decodes. Model loading uses `dtype` and `device`; everything else is the engine's."""

    strategy: str = _option("ragged", "eqspec (realign every round), exspec (a pool of same-length groups) or "
                                      "ragged (per-row offsets, continuous refill)")
    num_draft_tokens: int = _option(4, "k: the most tokens a row proposes in a round")
    tree_branches: int = _option(1, "candidates verified per drafted position (ragged, greedy): each proposal's "
                                    "b - 1 next most likely draft tokens are verified as leaves in the same forward, "
                                    "so a row whose proposal misses may still accept one of them; 1: a chain")
    batch_size: int = _option(8, "rows decoded together (ragged: slots)")
    max_new_tokens: int = _option(128, "new tokens per request at most (the API also takes one per prompt)")
    draft_threshold: float = _option(0.7, "a row stops drafting when the draft's confidence (probability of its "
                                          "most likely next token) falls below this; 0: never")
    draft_floor: float = _option(0.2, "the step that stops a row still proposes its token if the confidence is "
                                      "at least this (at most the threshold; equal to it: never)")
    policy: str | None = _option(None, "how far rows draft (fast.policy): goodput (priced from measured costs), "
                                       "threshold (draft_threshold and draft_floor) or fixed (k every round); "
                                       "None: goodput, except threshold under rejection sampling")
    temperature: float = _option(0.0, "0: greedy decoding; above 0: sample")
    top_k: int | None = _option(None, "sample among the k most likely tokens (None: all)")
    top_p: float | None = _option(None, "sample from the smallest set of probability at least p (None: all)")
    repetition_penalty: float = _option(1.0, "divide a positive logit (multiply a negative one) by this for every token "
                                             "in the prompt or the new tokens (transformers' definition; 1: off)")
    presence_penalty: float = _option(0.0, "subtract this from the logit of every token already generated (OpenAI's "
                                           "definition, in [-2, 2])")
    frequency_penalty: float = _option(0.0, "subtract this times its count from the logit of every token already "
                                            "generated (OpenAI's definition, in [-2, 2])")
    logit_bias: dict | None = _option(None, "{token id: bias} added to the logits (OpenAI's definition, bias in "
                                            "[-100, 100]; the API also takes one per prompt)")
    min_tokens: int = _option(0, "EOS ids are excluded until this many new tokens exist")
    min_p: float = _option(0.0, "when sampling, keep only tokens of probability at least min_p times the most "
                                "likely one (applied after top-k and top-p; 0: off)")
    stop: tuple = _option((), "stop strings (or one list per prompt): a request ends at the token whose text completes one (needs a "
                              "tokenizer); the returned text ends before it")
    sampling: str = _option("rejection", "rejection (the target's distribution exactly) or coupled (the same "
                                         "tokens as target-only sampling with the same seed)")
    seed: int = _option(0, "sampling seed, an integer in [0, 2^63) (the API also takes one per prompt)")
    dtype: str = _option("float32", "dtype the models are loaded in")
    device: str = _option("cpu", "device the models are loaded on: cpu, cuda, cuda:1, ...")
    prepack: bool = _option(True, "CPU linear layers on oneDNN-prepacked weights or torch's product, whichever a step "
                                  "measured faster (float32/bfloat16)")
    compile: bool = _option(False, "torch.compile the MLP blocks and norms (inductor)")
    lean: bool = _option(True, "run Llama-architecture models through fast.compute.lean_llama (fused q/k/v and gate/up "
                               "products, fused norms: fewer operations per layer); other models run as they are")
    native: bool = _option(True, "run the lean forward's blocks of ragged decode and verify steps in one C++ call, "
                                 "and its RMS norms, rotations and SiLU products as one vectorized kernel each "
                                 "(fast.compute.native: compiled once per machine; torch's operators in Python "
                                 "where it cannot be built)")
    max_wait: int = _option(4, "exspec: rounds a row may wait for a same-length group")
    pool_window: int | None = _option(None, "exspec: rows the pool looks at (None: 4 x batch_size)")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def help(cls, name: str, command: str | None = None) -> str:
        """The field's help text with the default in force for `command`, for the CLI."""
        return f"{cls.__dataclass_fields__[name].metadata['help']} (default: {getattr(defaults(command), name)})"


DEFAULTS = GenerateOptions()

# Where a command runs a shorter preset than a generation run; the rest comes from DEFAULTS.
COMMAND_DEFAULTS = {
    "bench": dict(max_new_tokens=64),
    "demo": dict(batch_size=2, max_new_tokens=48),  # a latency-bound batch, short answers
}


def defaults(command: str | None = None) -> GenerateOptions:
    """The defaults in force (`DEFAULTS`, read at call time), with `command`'s preset applied."""
    return dataclasses.replace(DEFAULTS, **COMMAND_DEFAULTS.get(command, {}))


def resolve(options: GenerateOptions | None, overrides: dict) -> tuple[GenerateOptions, bool]:
    """`options` (default: defaults()) with keyword overrides applied, and whether the caller chose
    the draft floor (a floor above the threshold is refused when chosen, lowered when it is the default)."""
    if options is not None and not isinstance(options, GenerateOptions):
        raise TypeError(f"options must be a specbatch.GenerateOptions, got {type(options).__name__}")
    base = options if options is not None else defaults()
    names = GenerateOptions.names()
    for name in overrides:
        if name not in names:
            near = difflib.get_close_matches(name, names, n=1)
            raise TypeError(f"unknown option {name!r}" + (f"; did you mean {near[0]!r}?" if near else ""))
    floor_chosen = "draft_floor" in overrides or base.draft_floor != DEFAULTS.draft_floor
    return dataclasses.replace(base, **overrides), floor_chosen


class OptionError(SpecbatchError, ValueError):
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
    """0 (greedy) or a normal float: a subnormal one has no finite reciprocal to scale logits by."""
    t = check_real("temperature", value, 0.0)
    if t != 0.0 and (t < sys.float_info.min or not math.isfinite(1.0 / t)):
        raise OptionError(f"temperature must be 0 (greedy) or a normal positive number (at least "
                          f"{sys.float_info.min:.3g}), got {value!r}")
    return t


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


def strategy_names() -> tuple:
    """The strategies the torch engine has (fast.strategies.STRATEGIES: its registry, imported here
    only when asked, so that the NumPy reference can read the defaults without torch)."""
    from .fast.strategies import STRATEGIES
    return tuple(STRATEGIES)


def check_choice(what: str, value, choices) -> str:
    if value not in choices:
        raise OptionError(f"unknown {what} {value!r}; expected one of {', '.join(map(repr, choices))}")
    return value


def check_options(o: GenerateOptions, num_prompts: int, floor_chosen: bool = True) -> GenerateOptions:
    """Every field of `o` in range (OptionError naming the first that is not); returns `o` with the
    draft floor lowered to the threshold where the floor is the default and the threshold is lower."""
    check_choice("strategy", o.strategy, strategy_names())
    check_choice("sampling mode", o.sampling, SAMPLING_MODES)
    check_choice("dtype", o.dtype, DTYPES)
    check_int("num_draft_tokens", o.num_draft_tokens)
    check_int("batch_size", o.batch_size)
    check_int("tree_branches", o.tree_branches)
    for m in (o.max_new_tokens if isinstance(o.max_new_tokens, (list, tuple)) else [o.max_new_tokens]):
        check_int("max_new_tokens", m)
    check_probability("draft_threshold", o.draft_threshold)
    check_probability("draft_floor", o.draft_floor)
    if o.draft_floor > o.draft_threshold:
        if floor_chosen:
            raise OptionError(f"draft_floor must be <= draft_threshold ({o.draft_threshold:g}): it says whether the "
                              f"step that stops a row still proposes; got {o.draft_floor!r}")
        o = dataclasses.replace(o, draft_floor=o.draft_threshold)
    if o.policy not in (None, "goodput", "threshold", "fixed"):
        raise OptionError(f"policy must be goodput, threshold or fixed, got {o.policy!r}")
    check_temperature(o.temperature)
    if o.top_k is not None:
        check_top_k(o.top_k)
    if o.top_p is not None:
        check_top_p(o.top_p)
    check_seed(o.seed, num_prompts)
    check_processors(o, num_prompts)
    check_int("max_wait", o.max_wait, 0)
    if o.pool_window is not None:
        check_int("pool_window", o.pool_window)
    for name in ("prepack", "compile", "lean", "native"):
        if not isinstance(getattr(o, name), bool):
            raise OptionError(f"{name} must be True or False, got {getattr(o, name)!r}")
    return o


PENALTY_LIMIT, BIAS_LIMIT = 2.0, 100.0  # OpenAI's ranges of presence/frequency penalties and logit biases


def per_prompt(name: str, value, count: int | None) -> list:
    """A value for every prompt: one given for all, or a list of one per prompt."""
    if isinstance(value, (list, tuple)):
        if count is not None and len(value) != count:
            raise OptionError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * (count or 1)


def check_logit_bias(value) -> dict:
    """{token id: finite bias in [-100, 100]}; the ids are judged against the vocabulary by the API."""
    if not isinstance(value, dict):
        raise OptionError(f"logit_bias must be a dict of token id -> bias, got {type(value).__name__}")
    for token, bias in value.items():
        if not _is_int(token) or token < 0:
            raise OptionError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        check_real(f"logit_bias[{token}]", bias, -BIAS_LIMIT, BIAS_LIMIT)
    return {int(t): float(b) for t, b in value.items()}


def check_stop(value) -> tuple:
    """Stop strings: a list of non-empty strings (one string is one stop string)."""
    stops = (value,) if isinstance(value, str) else value
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise OptionError(f"stop must be a list of non-empty strings, got {value!r}")
    return tuple(stops)


def stops_per_prompt(value, count: int | None) -> list[tuple]:
    """The stop strings of every prompt: a string or a list of strings for all, or a list with one
    entry per prompt, each a string, a list of strings or None (none for that prompt)."""
    if isinstance(value, (list, tuple)) and value and not all(isinstance(s, str) for s in value):
        return [() if stops is None else check_stop(stops) for stops in per_prompt("stop", value, count)]
    return [check_stop(value)] * (count or 1)


def check_processors(o: GenerateOptions, num_prompts: int | None) -> None:
    """The processor fields: numbers for all prompts or one per prompt, each in its range."""
    for r in per_prompt("repetition_penalty", o.repetition_penalty, num_prompts):
        check_real("repetition_penalty", r, 0.0, low_open=True)
    for name in ("presence_penalty", "frequency_penalty"):
        for v in per_prompt(name, getattr(o, name), num_prompts):
            check_real(name, v, -PENALTY_LIMIT, PENALTY_LIMIT)
    for v in per_prompt("min_p", o.min_p, num_prompts):
        check_probability("min_p", v)
    budgets = per_prompt("max_new_tokens", o.max_new_tokens, num_prompts)
    for v, budget in zip(per_prompt("min_tokens", o.min_tokens, num_prompts), budgets):
        check_int("min_tokens", v, 0)
        if v > budget:
            raise OptionError(f"min_tokens ({v}) must be at most max_new_tokens ({budget})")
    if o.logit_bias is not None:
        for bias in per_prompt("logit_bias", o.logit_bias, num_prompts):
            if bias is not None:  # None in a list: none for that prompt
                check_logit_bias(bias)
    stops_per_prompt(o.stop, num_prompts)


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
