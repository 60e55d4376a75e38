"""Linear layers on prepacked weights (oneDNN) for CPU decoding.

A decoding step multiplies a few rows (the batch, or batch x (k + 1) when verifying) by every
weight matrix of the model. On this CPU, torch's default path for such small products reaches a
third to a half of what oneDNN reaches once a weight is reordered into its blocked layout ahead of
time (measured for SmolLM2-135M at 13 rows: the linear layers of 30 blocks take 51 ms plainly and
24 ms prepacked; the 49,152-row output head 20 ms and 6 ms). This is what torch.compile's freezing
does for linear layers, without compiling.

`prepacked_linears(models)` makes every `nn.Linear` inside the given models (CPU, float32 or
bfloat16) compute with a prepacked copy of its weight for the duration of a block, and restores
the modules afterwards. The copy is made once and kept beside the module (keyed by the weight's
storage and version, so a changed weight is repacked); it costs a second copy of the linear
weights in memory (`generate(..., prepack=False)` turns it off). Where oneDNN is unavailable or
refuses a layer, the layer stays as it is. Row counts oneDNN runs more slowly than a slightly larger
count are padded to it, and row counts that torch's own product on the unpacked weight runs faster
over a whole step stay with it, as measured on the machine (fast.compute.row_plan).

The result equals the plain product up to floating-point rounding (a different summation order);
target-only decoding (`ar`) and speculative decoding run through the same layers, so outputs are
compared like for like (tests/test_kernels.py).
"""
from __future__ import annotations

import time
import weakref
from contextlib import contextmanager

import torch

from . import row_plan

PACKABLE = (torch.float32, torch.bfloat16)

_SWAPS = 0  # how many times prepacked_linears or compiled_blocks swapped linear forwards in or out


def swaps() -> int:
    """A count that changes whenever prepacked_linears or compiled_blocks swaps the forwards of some
    modules in or out: what was derived from the modules' forwards stays valid while it is the same."""
    return _SWAPS


def _swapped():
    global _SWAPS
    _SWAPS += 1


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


PACKED: "weakref.WeakKeyDictionary[torch.nn.Linear, tuple]" = weakref.WeakKeyDictionary()  # module -> (key, packed)


def _packed_weight(module: torch.nn.Linear):
    """The module's prepacked weight, made on first use and again whenever the weight changed.
    Kept beside the module (not in it), so copying or saving the module is unaffected."""
    weight = module.weight
    key = (weight.data_ptr(), weight._version, weight.dtype, weight.shape)
    cached = PACKED.get(module)
    if cached is None or cached[0] != key:
        with torch.inference_mode():
            cached = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
        PACKED[module] = cached
    return cached[1]


PAD_ROWS = True  # pad row counts oneDNN runs slowly to a cheaper count, as measured (fast.compute.row_plan)


class PackedForward:
    """A linear module's forward on its packed weight, or torch's product where the plans chose it;
    plans: the process's row_plan.RowPlans, or None (no padding, always packed)."""

    def __init__(self, module: torch.nn.Linear, packed, plans, key: str, time_pass, time_step):
        self.module, self.packed, self.plans, self.key = module, packed, plans, key
        self.time_pass, self.time_step = time_pass, time_step

    def plan(self, rows: int, dtype) -> int:
        """row_plan.product's plan for `rows` rows of `dtype`: PLAIN, or the rows to pad to."""
        plans = self.plans
        if dtype != self.packed.dtype or (plans is not None and plans.plain_for(self.key, rows, self.time_step)):
            return row_plan.PLAIN  # mixed precision, or measured faster
        return plans.rows_for(self.key, rows, self.time_pass) if plans is not None else rows

    def __call__(self, x):
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return row_plan.product(x, self.module.weight, self.packed, self.module.bias, self.plan(rows, x.dtype))


def _linears(models, skip=()):
    seen, inside_skipped = {}, set()
    for block in skip:
        inside_skipped |= {id(m) for m in block.modules()}
    for root in models:
        if root is None:
            continue
        for m in root.modules():
            if type(m) is torch.nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype in PACKABLE \
                    and id(m) not in inside_skipped:
                seen[id(m)] = m
    return list(seen.values())


def _row_classes(models, skip=()):
    """(class key, its timer, its (module, packed weight) members) of each shape class
    (fast.compute.row_plan) of the linears inside `models` oneDNN packs; a layer it refuses (a shape
    or type it does not take) is left out, and stays as it is."""
    classes: dict = {}
    for module in _linears(models, skip):
        try:
            packed = _packed_weight(module)
        except RuntimeError:
            continue
        classes.setdefault((tuple(module.weight.shape), module.weight.dtype), []).append((module, packed))
    for members in classes.values():
        weight = members[0][0].weight
        yield (row_plan.RowPlans.class_key(weight), row_plan.class_timer([p for _, p in members], weight.shape[1],
                                                                         weight.dtype), members)


def step_timer(classes: list):
    """time_step for row_plan.RowPlans.plain_for over the shape classes (key, time_pass, members) of
    one forward: a warm pass, then row_plan.REPEATS, each over every weight of every class in the
    order a forward reads them (the i-th weight of each class in turn), once with torch's product on
    the unpacked weights and once with the packed ones, in alternating order. Returns {class key:
    (plain seconds, packed seconds) per pass}, each class's own products timed within the passes."""
    longest = max((len(members) for _, _, members in classes), default=0)
    order = [(key, *members[i]) for i in range(longest) for key, _, members in classes if i < len(members)]

    def time_step(rows: int) -> dict:
        inputs = {key: torch.randn(rows, members[0][0].weight.shape[1]).to(members[0][0].weight.dtype)
                  for key, _, members in classes}
        spent = {key: ([], []) for key in inputs}  # plain, packed
        for repeat in range(row_plan.REPEATS + 1):
            for plain in ((True, False) if repeat % 2 else (False, True)):
                seconds = dict.fromkeys(inputs, 0.0)
                for key, module, packed in order:
                    start = time.perf_counter()
                    row_plan.product(inputs[key], module.weight, packed, None, row_plan.PLAIN if plain else rows)
                    seconds[key] += time.perf_counter() - start
                if repeat:  # the first pass warms both kernels up
                    for key, value in seconds.items():
                        spent[key][0 if plain else 1].append(value)
        return spent
    return time_step


def prepare_row_plans(*models, up_to: int, skip=()) -> int:
    """Decide now the kernel and padding of every row count 1..up_to (at most row_plan.MAX_ROWS) for
    the shape classes of the prepackable linears inside `models` (but not inside `skip`, as
    prepacked_linears), so that no forward measures later (a benchmark calls this before it times
    anything). Returns the number of decisions made here."""
    if not (PAD_ROWS and available()):
        return 0
    plans = row_plan.plans()
    decided = lambda: sum(len(e.get("padded", {})) + len(e.get("plain", {})) for e in plans.classes.values())  # noqa: E731
    before = decided()
    with torch.inference_mode():
        classes = list(_row_classes(models, skip))
        time_step = step_timer(classes)
        for rows in range(1, min(up_to, row_plan.MAX_ROWS) + 1):
            for key, time_pass, _ in classes:
                plans.plain_for(key, rows, time_step)
                plans.rows_for(key, rows, time_pass)
    return decided() - before


@contextmanager
def prepacked_linears(*models, enabled: bool = True, skip=()):
    """Compute every eligible nn.Linear inside `models` (but not inside the modules `skip`) with a
    prepacked weight in this block."""
    swapped = []
    try:
        if enabled and available():
            plans = row_plan.plans() if PAD_ROWS else None  # looked up once for the block, not per product
            classes = list(_row_classes(models, skip))
            time_step = step_timer(classes)
            for key, time_pass, members in classes:
                for module, packed in members:
                    module.forward = PackedForward(module, packed, plans, key, time_pass, time_step)
                    swapped.append(module)
            _swapped()
        yield len(swapped)
    finally:
        for module in swapped:
            del module.forward  # the class's own forward again
        _swapped()


def _compilable(models):
    """Each model's MLP blocks and normalisation layers: the pointwise-heavy parts that inductor
    can fuse (attention and the cache stay eager: they depend on the round's row groups)."""
    seen = {}
    for root in models:
        if root is None:
            continue
        for m in root.modules():
            name = type(m).__name__
            if name.endswith("MLP") or name.endswith("RMSNorm") or isinstance(m, torch.nn.LayerNorm):
                seen[id(m)] = m
    return list(seen.values())


@contextmanager
def compiled_blocks(*models, enabled: bool = False, cache_dir=None):
    """torch.compile (inductor, freezing, dynamic shapes) every MLP block and normalisation layer of
    `models` for the duration of the block; yields the modules compiled (their linear layers are
    then inductor's, not prepacked). The compiled code is cached on disk in `cache_dir` (default
    $SPECBATCH_CACHE/inductor), so a second run does not compile again."""
    if not enabled:
        yield []
        return
    import os

    import torch._dynamo
    import torch._inductor.config as inductor_config
    from ..loading import cache_dir as default_cache_dir
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir or default_cache_dir() / "inductor"))
    modules = _compilable(models)
    saved = (inductor_config.freezing, torch._dynamo.config.cache_size_limit)
    inductor_config.freezing = True  # weights become constants: inductor prepacks them itself
    torch._dynamo.config.cache_size_limit = max(saved[1], 4 * len(modules))
    try:
        for module in modules:
            module.forward = torch.compile(type(module).forward.__get__(module), dynamic=True)
        _swapped()
        yield modules
    finally:
        for module in modules:
            vars(module).pop("forward", None)
        _swapped()
        inductor_config.freezing, torch._dynamo.config.cache_size_limit = saved
