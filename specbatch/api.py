"""`specbatch.generate`: batch speculative decoding on any pair of Hugging Face causal LMs."""
from __future__ import annotations

import functools
import numbers
import time

import torch

from .fast.attention import engine_attention
from .fast.kernels import compiled_blocks, prepacked_linears
from .fast.proposals import DraftController
from .fast.engine import Arrivals, Clock, GenerationResult, Settings, Stats
from .fast.sampling import make_chooser
from .fast.models import ModelRunner, attention_window, check_pair, context_limit, eos_ids_of, mask_fill_value
from .invariants import TraceWriter
from .options import (DEFAULTS, STRATEGIES, OptionError, check_arrivals, check_int, check_probability, check_seed,
                      check_temperature, check_token_id, check_token_ids, check_top_k, check_top_p)

BROKEN = ("bsp-like", "dsd-like")  # deliberately wrong: generate_variant (bench, tests) only


def _prompt_ids(prompts, tokenizer, vocab: int) -> list[list[int]]:
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists (or strings with tokenizer=)")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"prompt {i} is a string; pass tokenizer= to encode strings")
            prompt = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if not isinstance(prompt, (list, tuple)) and not hasattr(prompt, "tolist"):
            raise ValueError(f"prompt {i} must be a list of token ids, got {type(prompt).__name__}")
        ids = list(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
        if not ids:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise ValueError(f"prompt {i} has token id {t!r}, not an integer")
            if not 0 <= t < vocab:
                raise ValueError(f"prompt {i} has token id {t} outside the vocabulary [0, {vocab})")
        out.append([int(t) for t in ids])
    return out


def _positive(name: str, value, allow_list: bool = False):
    values = list(value) if allow_list and isinstance(value, (list, tuple)) else [value]
    for v in values:
        check_int(name, v)


def generate(target, draft, prompts, *, max_new_tokens, num_draft_tokens: int = DEFAULTS["num_draft_tokens"],
             batch_size: int = DEFAULTS["batch_size"], strategy: str = DEFAULTS["strategy"], eos_token_id=None,
             pad_token_id=None, tokenizer=None, draft_tokenizer=None, check_invariants: bool = False, trace=None,
             progress: bool = False, pool_window: int | None = None, max_wait: int = DEFAULTS["max_wait"],
             on_result=None, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed=DEFAULTS["seed"],
             sampling: str = "rejection", arrivals=None, request_ids=None, prepack: bool = True,
             compile: bool = False, draft_threshold: float | None = None, draft_floor: float | None = None,
             adaptive: bool | None = None) -> GenerationResult:
    """Generate with `target`, drafting with `draft` (None: target-only decoding, same code path).

    Greedy output equals target-only greedy decoding token for token (proofs_notes/).
    prompts: token-id lists, or strings with tokenizer=. Request id = index in prompts.
    max_new_tokens: int, or one per prompt. eos_token_id: int or list; default: every id in
    target.generation_config.eos_token_id. Results come back in input order.
    strategy: "ragged" (default: per-row offsets, no realignment, continuous refill), "eqspec"
    (realign every round), "exspec" (pool of same-length groups; pool_window rows, default
    4 x batch_size, and max_wait rounds of bounded waiting). Defaults: specbatch.options.DEFAULTS,
    the same as the CLI's.
    temperature 0 is greedy; otherwise tokens are sampled after temperature / top_k / top_p (the same
    processors for target and draft): sampling="rejection" keeps the target's distribution exactly,
    sampling="coupled" equals target-only coupled sampling with the same seed token for token.
    seed: int in [0, 2^63), or one per prompt; randomness is keyed by (seed, request, position),
    never by slot.
    check_invariants: check I1-I6 every round (slow; raises invariants.InvariantError).
    trace: path of a JSONL round trace (invariants.trace format).
    arrivals: optional arrival time (seconds after the start, finite, nondecreasing) per request, for
    latency benchmarks: a request is not scheduled before it arrives; request_stats then hold its latency.
    request_ids: the ids that key sampling randomness (default: the prompt indices); data-parallel
    shards pass global ids so that sharding cannot change sampled outputs.
    on_result: called as on_result(request, tokens, stop_reason, rounds) when a request finishes.
    prepack: on CPU, compute float32/bfloat16 linear layers with oneDNN-prepacked weights (fast.kernels;
    a second copy of those weights is kept beside the modules); False: transformers' own layers.
    num_draft_tokens: k, the most tokens a row proposes in a round. How many it does propose is
    decided per row (fast.proposals): it stops when the draft's confidence (probability of its most
    likely next token) falls below draft_threshold (default 0.7; 0: never), proposing the token it
    stops at if its confidence is at least draft_floor (default 0.2, or draft_threshold if that is
    lower; draft_floor=draft_threshold: never), and adaptive=True lets a
    cost-aware controller cap each row's proposals from measured step costs and the row's history
    (all caps 0 make a plain target step). adaptive=None: on, except for rejection sampling (where a
    cap that depends on batch and timing would make seeded outputs depend on them). Fixed k:
    draft_threshold=0, adaptive=False.
    compile: torch.compile (inductor) the MLP blocks and normalisation layers, compiled code cached
    on disk (fast.kernels.compiled_blocks). Measured on the 2-core CPU: slower than prepack (README).
    Bad arguments raise ValueError (specbatch.options.OptionError for numbers) naming the argument.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    return _generate(**locals())


def generate_variant(target, draft, prompts, *, variant: str, **options) -> GenerationResult:
    """The deliberately broken bsp-like / dsd-like variants (bench's correctness table and the tests
    that show the checkers catch them), with generate's arguments. Never for real outputs."""
    if variant not in BROKEN:
        raise ValueError(f"unknown variant {variant!r}; expected one of {', '.join(BROKEN)}")
    options.setdefault("num_draft_tokens", DEFAULTS["num_draft_tokens"])
    options.setdefault("batch_size", DEFAULTS["batch_size"])
    return _generate(target, draft, prompts, strategy=variant, **options)


def _generate(target, draft, prompts, *, max_new_tokens, num_draft_tokens: int, batch_size: int, strategy: str,
              eos_token_id=None, pad_token_id=None, tokenizer=None, draft_tokenizer=None,
              check_invariants: bool = False, trace=None, progress: bool = False, pool_window: int | None = None,
              max_wait: int = DEFAULTS["max_wait"], on_result=None, temperature: float = 0.0,
              top_k: int | None = None, top_p: float | None = None, seed=DEFAULTS["seed"],
              sampling: str = "rejection", arrivals=None, request_ids=None, prepack: bool = True,
              compile: bool = False, draft_threshold: float | None = None, draft_floor: float | None = None,
              adaptive: bool | None = None) -> GenerationResult:
    check_temperature(temperature)
    if sampling not in ("rejection", "coupled"):
        raise ValueError(f"unknown sampling mode {sampling!r}; expected 'rejection' or 'coupled'")
    if top_k is not None:
        check_top_k(top_k)
    if top_p is not None:
        check_top_p(top_p)
    if draft_threshold is not None:
        check_probability("draft_threshold", draft_threshold)
    if draft_floor is not None:
        check_probability("draft_floor", draft_floor)
        ceiling = DEFAULTS["draft_threshold"] if draft_threshold is None else draft_threshold
        if draft_floor > ceiling:
            raise OptionError(f"draft_floor must be <= draft_threshold ({ceiling:g}): it says whether the step that "
                              f"stops a row still proposes; got {draft_floor!r}")
    if not isinstance(prompts, (list, tuple)):
        raise ValueError("prompts must be a non-empty list of token-id lists (or strings with tokenizer=)")
    check_seed(seed, len(prompts))
    if arrivals is not None:
        arrivals = check_arrivals(arrivals, len(prompts))
    _positive("num_draft_tokens", num_draft_tokens)
    _positive("batch_size", batch_size)
    if pool_window is not None:
        _positive("pool_window", pool_window)
    check_int("max_wait", max_wait, 0)
    _positive("max_new_tokens", max_new_tokens, allow_list=True)
    check_pair(target, draft, tokenizer, draft_tokenizer)
    if draft is not None and getattr(draft, "reads_features", False) and strategy != "ragged":
        raise ValueError(f"the draft reads the target's features (a feature draft, fast.feature_draft); only "
                         f"strategy='ragged' keeps them, got strategy={strategy!r}")
    from .fast.models import vocab_size
    vocab = vocab_size(target)
    if eos_token_id is not None:
        eos_token_id = list(check_token_ids("eos_token_id", eos_token_id, vocab))
    if pad_token_id is not None:
        check_token_id("pad_token_id", pad_token_id, vocab)
    ids = _prompt_ids(prompts, tokenizer, vocab)
    max_new = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(ids)
    if len(max_new) != len(ids):
        raise ValueError(f"max_new_tokens has {len(max_new)} entries for {len(ids)} prompts")
    k = num_draft_tokens if draft is not None else 0

    longest = max(len(p) + m for p, m in zip(ids, max_new)) + k
    for name, model in (("target", target), ("draft", draft)):
        if model is None:
            continue
        limit = context_limit(model)
        if limit is not None:
            for i, (p, m) in enumerate(zip(ids, max_new)):
                if len(p) + m + k > limit:
                    raise ValueError(f"prompt {i}: {len(p)} prompt tokens + {m} new + {k} draft tokens exceed the "
                                     f"{name}'s context of {limit} positions")
    window = None
    for name, model in (("target", target), ("draft", draft)):
        if model is None:
            continue
        w, uniform = attention_window(model)
        if w is not None and longest > w:
            if not uniform:
                raise ValueError(f"the {name} mixes sliding-window ({w}) and full attention layers and sequences "
                                 f"reach {longest} tokens; this is not supported (keep prompt + new tokens <= {w})")
            if window is not None and window != w:
                raise ValueError(f"target and draft have different sliding windows ({window} and {w})")
            window = w

    first = next(iter(list(target.parameters()) + list(target.buffers())))
    device, dtype = first.device, first.dtype
    eos_ids = eos_ids_of(target, eos_token_id)
    pad_id = pad_token_id if pad_token_id is not None else (getattr(target.config, "pad_token_id", None) or 0)
    stats = Stats()
    writer = None
    threshold = float(DEFAULTS["draft_threshold"] if draft_threshold is None else draft_threshold) if k else 0.0
    floor = min(float(DEFAULTS["draft_floor"]), threshold) if draft_floor is None else float(draft_floor)
    if adaptive is None:
        adaptive = not (temperature and sampling == "rejection")
    if trace is not None:
        writer = TraceWriter(trace, layout="ragged" if strategy == "ragged" else "rectangular", strategy=strategy,
                             eos_token_ids=eos_ids, max_new_tokens=max_new, num_requests=len(ids), window=window,
                             num_draft_tokens=k, draft_threshold=threshold, draft_floor=floor)
    settings = Settings(k=k, eos_ids=eos_ids, window=window, dtype=dtype, device=device, fill=mask_fill_value(dtype),
                        pad_id=int(pad_id), check=check_invariants, trace=writer,
                        chooser=make_chooser(temperature, top_k, top_p, seed, sampling, len(ids), device,
                                             request_ids),
                        threshold=threshold, floor=floor, controller=DraftController(k, bool(adaptive)) if k else None)
    target_runner = ModelRunner(target)
    draft_runner = ModelRunner(draft) if draft is not None else None
    results: dict = {}
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(ids), desc=f"{strategy}", unit="req", leave=False)

    def on_done(request, tokens, reason, rounds):
        results[request] = (tokens, reason, rounds, time.perf_counter() - start)
        if on_result is not None:
            on_result(request, tokens, reason, rounds)
        if bar is not None:
            bar.update(1)
            elapsed = time.perf_counter() - start
            tau = stats.generated_tokens / stats.row_rounds if stats.row_rounds else 0.0
            bar.set_postfix(tok_s=f"{stats.generated_tokens / elapsed:.1f}", tau=f"{tau:.2f}")

    start = time.perf_counter()
    settings.arrivals = Arrivals(len(ids), arrivals)
    clock = Clock(stats, device)
    from .fast.strategies import broken, eqspec, exspec, ragged
    run = {"eqspec": eqspec.run, "ragged": ragged.run, "bsp-like": broken.run_bsp_like,
           "dsd-like": broken.run_dsd_like,
           "exspec": functools.partial(exspec.run, pool_window=pool_window, max_wait=max_wait)}[strategy]
    try:
        with torch.inference_mode(), engine_attention(target, draft), \
                compiled_blocks(target, draft, enabled=compile) as compiled, \
                prepacked_linears(target, draft, enabled=prepack, skip=compiled):
            run(target_runner, draft_runner, ids, max_new, settings, stats, clock, batch_size, on_done)
    finally:  # an error (or Ctrl-C) leaves no half-drawn bar in front of its message
        if bar is not None:
            bar.close()
    stats.time_total = time.perf_counter() - start
    stats.target_tokens_processed = target_runner.tokens_processed
    stats.draft_tokens_processed = draft_runner.tokens_processed if draft_runner else 0
    sequences = [results[r][0] for r in range(len(ids))]
    reasons = [results[r][1] for r in range(len(ids))]
    if writer is not None:
        writer.results(sequences, reasons)
    texts = [tokenizer.decode(s) for s in sequences] if tokenizer is not None else None
    per_request = [dict(rounds=results[r][2], accepted_length=len(results[r][0]) / max(results[r][2], 1),
                        latency=results[r][3] - (arrivals[r] if arrivals is not None else 0.0))
                   for r in range(len(ids))]
    return GenerationResult(sequences, reasons, stats.as_dict(), texts, per_request)
