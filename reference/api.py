"""`reference.generate`: the NumPy twin of `specbatch.generate`, with its name, parameter names and
defaults (the same `GenerateOptions`, read from `specbatch.options.defaults()` at call time), so
that a reader can diff the two calls.

The reference decodes greedily, with the options that decide greedy output and its rounds:
strategy, num_draft_tokens, tree_branches (ragged: token trees, reference.trees), batch_size,
max_new_tokens, draft_threshold, draft_floor, policy, pool_window and max_wait. Options that only change speed (dtype, device, prepack, compile, lean,
seed, sampling) are accepted and have no effect; sampling and processor options away from their
defaults are refused (reference.sampling and reference.processors state those per query). It has
no clock, so the goodput policy, which prices proposals from measured costs, is not available:
policy None means fixed here, which drafts every row's limit (greedy output is the same under every
policy). Two parameters exist only here: `arrival_order` (the order requests are submitted; the
API's `arrivals` are times) and `window` (the models' sliding attention window).
"""
from __future__ import annotations

import numpy as np

from ..invariants import TraceWriter
from ..options import GenerateOptions, check_choice, per_prompt, resolve
from .engine import Options, ReferenceResult
from .strategies import STRATEGIES, Job

SPEED_ONLY = ("dtype", "device", "prepack", "compile", "lean", "seed", "sampling")
ROUND_OPTIONS = ("strategy", "num_draft_tokens", "batch_size", "max_new_tokens", "draft_threshold", "draft_floor",
                 "policy", "pool_window", "max_wait", "tree_branches")


def generate(target, draft, prompts, options: GenerateOptions | None = None, *, eos_token_id=(), pad_token_id=0,
             check_invariants: bool = False, trace=None, arrival_order=None, window: int | None = None,
             **settings) -> ReferenceResult:
    """Reference batch speculative decoding; `draft=None` is target-only decoding. Every strategy
    returns exactly `greedy_decode`'s tokens for every request (I5, I6), in input order (S2).

    options / settings: a GenerateOptions and any of its fields by keyword, as in specbatch.generate.
    eos_token_id: the EOS ids (an int or a list). check_invariants: check I1-I7 and S1 every round
    (raises invariants.InvariantError). trace: path of a JSONL round trace (invariants.trace)."""
    opts, _ = resolve(options, settings)
    check_choice("strategy", opts.strategy, tuple(STRATEGIES))
    unsupported = [name for name in GenerateOptions.names() if name not in ROUND_OPTIONS + SPEED_ONLY
                   and getattr(opts, name) != getattr(GenerateOptions(), name)]
    if unsupported:
        raise ValueError(f"the reference decodes greedily without processors; {unsupported[0]}="
                         f"{getattr(opts, unsupported[0])!r} is not supported (reference.sampling, reference.processors)")
    if opts.policy == "goodput":
        raise ValueError("the reference has no clock to price proposals with: use policy='fixed' or 'threshold' "
                         "(greedy output is the same under every policy)")
    eos_ids = (eos_token_id,) if np.isscalar(eos_token_id) else tuple(eos_token_id)
    k = opts.num_draft_tokens if draft is not None else 0
    branches = opts.tree_branches if k else 1
    if branches > 1 and (opts.strategy != "ragged" or trace is not None):
        raise ValueError(f"tree_branches={branches} runs in strategy='ragged' without a trace "
                         f"(reference.trees), got strategy={opts.strategy!r}" + (" and a trace" if trace else ""))
    threshold, floor = (opts.draft_threshold, min(opts.draft_floor, opts.draft_threshold)) \
        if opts.policy == "threshold" and k else (0.0, 0.0)
    count = len(prompts)
    max_new = per_prompt("max_new_tokens", opts.max_new_tokens, count)
    writer = None
    if trace is not None:
        writer = TraceWriter(trace, layout=STRATEGIES[opts.strategy].layout,
                             strategy=opts.strategy, eos_token_ids=eos_ids, max_new_tokens=max_new,
                             num_requests=count, window=window, num_draft_tokens=k, draft_threshold=threshold,
                             draft_floor=floor)
    job = Job(target, draft, prompts, max_new, list(range(count)) if arrival_order is None else list(arrival_order),
              Options(k=k, eos_ids=eos_ids, pad_id=pad_token_id, window=window, check=check_invariants,
                      threshold=threshold, floor=floor, branches=branches),
              opts.batch_size, opts.pool_window, opts.max_wait, writer)
    STRATEGIES[opts.strategy](job)
    sequences = [job.results[r].tokens[job.results[r].prompt_len:] for r in range(count)]
    stop_reasons = [job.results[r].stop_reason for r in range(count)]
    if writer is not None:
        writer.results(sequences, stop_reasons)
    return ReferenceResult(sequences, stop_reasons, job.stats)
