"""`specbatch.generate`: batch speculative decoding on any pair of Hugging Face causal LMs."""
from __future__ import annotations

import functools
import numbers
import time

import torch

from .fast.compute.attention import engine_attention
from .fast.compute.backend import for_device, held_whole
from .fast.compute.kernels import compiled_blocks, prepacked_linears
from .fast.policy import PolicySettings, make_policy
from .fast.engine import Arrivals, Clock, GenerationResult, Settings, Stats
from .fast.observer import observer_for
from .fast.processors import LogitProcessors
from .fast.sampling import make_chooser
from .fast.models import (ModelRunner, abilities_of, attention_window, check_pair, context_limit, eos_ids_of,
                          mask_fill_value, vocab_size)
from .invariants import TraceWriter
from .tensor_parallel import clock_agreement
from .options import (GenerateOptions, check_arrivals, check_choice, check_logit_bias, check_options,
                      check_stop, check_token_id, check_token_ids, per_prompt, resolve,
                      stops_per_prompt)
from .fast.strategies import BROKEN, STRATEGIES
from .reference.processors import PROCESSOR_SETTINGS, Processors, stop_text


def decode_text(tokens, tokenizer) -> str:
    """What a reader sees: special tokens (the chat template's end token, EOS) left out; the token
    ids keep everything."""
    return tokenizer.decode(tokens, skip_special_tokens=True)


def result_text(tokens, reason: str, tokenizer, stop=()) -> str:
    """decode_text of a result; a request that ended at a stop string ends before it."""
    text = decode_text(tokens, tokenizer)
    return stop_text(text, check_stop(stop)) if reason == "stop" else text


def encode_text(text: str, tokenizer, chat_template: bool | None) -> list[int]:
    """A string prompt's token ids: wrapped as one user turn in the tokenizer's chat template when
    it has one (chat_template None or True; True without a template is an error), else encoded as it is."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template and not has_template:
        raise ValueError("chat_template=True, but the tokenizer has no chat template; pass chat_template=False")
    if has_template and chat_template is not False:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def make_processors(opts: GenerateOptions, ids, max_new, eos_ids, vocab: int, device, tokenizer):
    """fast.processors.LogitProcessors for the requests' processor settings, None when none is set."""
    count = len(ids)
    biases = [check_logit_bias(bias or {}) for bias in per_prompt("logit_bias", opts.logit_bias, count)]
    for token in (t for bias in biases for t in bias):
        check_token_id("logit_bias key", token, vocab)
    stops = stops_per_prompt(opts.stop, count)
    if any(stops) and tokenizer is None:
        raise ValueError("stop strings are judged on the decoded text: pass tokenizer= with stop=")
    special = dict(logit_bias=biases, stop=stops)  # checked above; every other setting is one number per request
    default = Processors()
    columns = {name: special[name] if name in special else
               [type(getattr(default, name))(v) for v in per_prompt(name, getattr(opts, name), count)]
               for name in PROCESSOR_SETTINGS}
    settings = [Processors(**{name: column[i] for name, column in columns.items()}) for i in range(count)]
    if not any(s.changes_logits or s.min_p or s.stop for s in settings):
        return None
    decode = (lambda tokens: decode_text(tokens, tokenizer)) if any(stops) else None
    return LogitProcessors(settings, ids, max_new, eos_ids, device, decode)


def _prompt_ids(prompts, tokenizer, vocab: int, chat_template: bool | None = None) -> list[list[int]]:
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists (or strings with tokenizer=)")
    if chat_template not in (None, True, False):
        raise ValueError(f"chat_template must be None, True or False, got {chat_template!r}")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"prompt {i} is a string; pass tokenizer= to encode strings")
            prompt = encode_text(prompt, tokenizer, chat_template)
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


def generate(target, draft, prompts, options: GenerateOptions | None = None, *, eos_token_id=None,
             pad_token_id=None, tokenizer=None, draft_tokenizer=None, check_invariants: bool = False, trace=None,
             progress: bool = False, on_result=None, arrivals=None, request_ids=None, chat_template=None,
             **settings) -> GenerationResult:
    """Generate with `target`, drafting with `draft` (None: target-only decoding, same code path).

    Greedy output equals target-only greedy decoding token for token (proofs_notes/).
    prompts: token-id lists, or strings with tokenizer=. A string is one user turn in the tokenizer's
    chat template when it has one (chat_template=False: the string as it is; True: the template or
    an error). Request id = index in prompts; results come back in input order.
    options / settings: how to decode, a `specbatch.GenerateOptions` and any of its fields by keyword
    (strategy, num_draft_tokens, batch_size, max_new_tokens (int, or one per prompt), draft_threshold,
    draft_floor, policy, temperature, top_k, top_p, sampling, seed (int, or one per prompt),
    prepack, compile, max_wait, pool_window); a keyword wins over `options`, and what neither
    gives comes from `specbatch.options.defaults()`. docs/api.md describes each field.
    eos_token_id: int or list; default: every id in target.generation_config.eos_token_id.
    check_invariants: check I1-I7 every round (slow; raises invariants.InvariantError).
    trace: path of a JSONL round trace (invariants.trace format).
    progress: a progress bar on stderr, labelled by the strategy (target-only without a draft), or by
    the string given.
    arrivals: optional arrival time (seconds after the start, finite, nondecreasing) per request, for
    latency benchmarks: a request is not scheduled before it arrives; request_stats then hold its latency.
    request_ids: the ids that key sampling randomness (default: the prompt indices); data-parallel
    shards pass global ids so that sharding cannot change sampled outputs.
    on_result: called as on_result(request, tokens, stop_reason, rounds) when a request finishes.
    Bad arguments raise ValueError (specbatch.options.OptionError for options) naming the argument;
    an unknown option name raises TypeError.
    """
    opts, floor_chosen = resolve(options, settings)
    return _generate(target, draft, prompts, opts, floor_chosen, eos_token_id=eos_token_id,
                     pad_token_id=pad_token_id, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer,
                     check_invariants=check_invariants, trace=trace, progress=progress, on_result=on_result,
                     arrivals=arrivals, request_ids=request_ids, chat_template=chat_template)


def generate_variant(target, draft, prompts, *, variant: str, **settings) -> GenerationResult:
    """The deliberately broken bsp-like / dsd-like variants (bench's correctness table and the tests
    that show the checkers catch them), with generate's arguments. Never for real outputs."""
    check_choice("variant", variant, tuple(BROKEN))
    call = {name: settings.pop(name) for name in list(settings) if name not in GenerateOptions.names()}
    opts, floor_chosen = resolve(None, settings)
    return _generate(target, draft, prompts, opts, floor_chosen, variant=variant, **call)


def _generate(target, draft, prompts, opts: GenerateOptions, floor_chosen: bool, *, variant: str | None = None,
              eos_token_id=None, pad_token_id=None, tokenizer=None, draft_tokenizer=None,
              check_invariants: bool = False, trace=None, progress: bool = False, on_result=None, arrivals=None,
              request_ids=None, chat_template=None) -> GenerationResult:
    """generate and generate_variant: check every input, build the engine's Settings, run the strategy."""
    if not isinstance(prompts, (list, tuple)):
        raise ValueError("prompts must be a non-empty list of token-id lists (or strings with tokenizer=)")
    opts = check_options(opts, len(prompts), floor_chosen)
    strategy = variant or opts.strategy
    runner = {**STRATEGIES, **BROKEN}[strategy](opts)
    agree = clock_agreement(target)  # None unless the target is sharded (tensor parallelism)
    if arrivals is not None:
        arrivals = check_arrivals(arrivals, len(prompts))
        if agree is not None:
            raise ValueError("arrivals= follow the clock, which the ranks of a tensor-parallel target do not share; "
                             "run latency benchmarks with the target held whole")
    _check_draft(target, draft, tokenizer, draft_tokenizer, runner, strategy)
    vocab = vocab_size(target)
    if eos_token_id is not None:
        eos_token_id = list(check_token_ids("eos_token_id", eos_token_id, vocab))
    if pad_token_id is not None:
        check_token_id("pad_token_id", pad_token_id, vocab)
    ids = _prompt_ids(prompts, tokenizer, vocab, chat_template)
    max_new = per_prompt("max_new_tokens", opts.max_new_tokens, len(ids))
    k = opts.num_draft_tokens if draft is not None else 0
    window = _sliding_window(target, draft, ids, max_new, k)
    settings, writer = _settings(target, opts, runner.layout, strategy, ids, max_new, k, window, eos_token_id,
                                 pad_token_id, vocab, tokenizer, check_invariants, trace, request_ids)
    settings.tree_branches = _tree_branches(opts, draft, k, runner, settings, vocab, trace)
    stats = Stats()
    target_runner = ModelRunner(target, lean=opts.lean and not opts.compile, native=opts.native)
    draft_runner = ModelRunner(draft, lean=opts.lean and not opts.compile, native=opts.native) \
        if draft is not None else None
    leans = [r.lean for r in (target_runner, draft_runner) if r is not None and r.lean is not None]
    whole = held_whole(target, draft)  # a tensor-parallel target keeps its sharded layers (fast.compute.backend)
    backend = settings.backend
    label = progress if isinstance(progress, str) else strategy if draft is not None else "target-only"
    results = _Results(len(ids), on_result, label if progress else None)  # the clock starts here
    settings.arrivals = Arrivals(len(ids), arrivals)  # ... and arrival times count from here
    try:
        with torch.inference_mode(), engine_attention(target, draft, fused=not backend.grouped_attention), \
                compiled_blocks(*whole, enabled=opts.compile) as compiled, \
                prepacked_linears(*whole, *leans, enabled=opts.prepack and backend.prepack_linears,
                                  skip=list(compiled) + [m for lean in leans for m in lean.replaced]):
            runner.run(target_runner, draft_runner, ids, max_new, settings, stats, Clock(stats, settings.device, agree),
                       opts.batch_size, functools.partial(results.done, stats))
    finally:  # an error (or Ctrl-C) leaves no half-drawn bar in front of its message
        results.close()
    stats.time_total = time.perf_counter() - results.start
    stats.target_tokens_processed = target_runner.tokens_processed
    stats.draft_tokens_processed = draft_runner.tokens_processed if draft_runner else 0
    return results.result(stats, writer, tokenizer, stops_per_prompt(opts.stop, len(ids)), arrivals)


def _check_draft(target, draft, tokenizer, draft_tokenizer, runner, strategy: str) -> None:
    """The draft shares the target's vocabulary (fast.models.check_pair), and a draft that reads the
    target's features runs only in a strategy that keeps them."""
    check_pair(target, draft, tokenizer, draft_tokenizer)
    if draft is not None and abilities_of(draft).reads_features and not runner.keeps_features:
        keeping = ", ".join(repr(name) for name, cls in STRATEGIES.items() if cls.keeps_features)
        raise ValueError(f"the draft reads the target's features (a feature draft, fast.drafts.feature_draft); only "
                         f"strategy={keeping} keeps them, got strategy={strategy!r}")


def _tree_branches(opts: GenerateOptions, draft, k: int, runner, settings, vocab: int, trace) -> int:
    """The round's candidates per drafted position (fast.trees): 1 without drafts or for a draft
    whose logits rank no candidates beyond its first (a prompt lookup alone proposes a chain);
    else opts.tree_branches, refused (ValueError) outside a strategy that verifies trees, with logit
    processors, or with a trace."""
    if opts.tree_branches == 1 or not k or not abilities_of(draft).ranks_candidates:
        return 1
    name = f"tree_branches={opts.tree_branches}"
    if not getattr(runner, "verifies_trees", False):
        verifying = ", ".join(repr(n) for n, cls in STRATEGIES.items() if getattr(cls, "verifies_trees", False))
        raise ValueError(f"{name} needs a strategy that verifies trees ({verifying}), got strategy={opts.strategy!r}")
    if opts.tree_branches > vocab:
        raise ValueError(f"{name} exceeds the candidates a vocabulary of {vocab} tokens has")
    refused = [(settings.processors is not None and settings.processors.changes_logits,
                "penalties, logit_bias or min_tokens: processors count the tokens of a chain, not of each node's path"),
               (trace is not None, "trace=: traces record chain rounds")]
    for refused_now, why in refused:
        if refused_now:
            raise ValueError(f"{name} does not run with {why}; use tree_branches=1")
    return opts.tree_branches


def _sliding_window(target, draft, ids, max_new, k: int) -> int | None:
    """The sliding attention window the engine must apply (None: none reached): every request must fit
    each model's context, and a window is supported when every layer uses it and both models agree."""
    longest = max(len(p) + m for p, m in zip(ids, max_new)) + k
    window = None
    for name, model in (("target", target), ("draft", draft)):
        if model is None:
            continue
        limit = context_limit(model)
        for i, (p, m) in enumerate(zip(ids, max_new)):
            if limit is not None and len(p) + m + k > limit:
                raise ValueError(f"prompt {i}: {len(p)} prompt tokens + {m} new + {k} draft tokens exceed the "
                                 f"{name}'s context of {limit} positions")
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
    return window


def _settings(target, opts: GenerateOptions, layout: str, strategy: str, ids, max_new, k: int, window, eos_token_id,
              pad_token_id, vocab: int, tokenizer, check_invariants: bool, trace, request_ids):
    """(the engine's Settings, the trace writer or None): device and dtype from the target, EOS and pad
    ids, the chooser and the processors, the proposal policy, and the observer of the rounds (invariant
    checks, the trace when trace is a path)."""
    first = next(iter(list(target.parameters()) + list(target.buffers())))
    device, dtype = first.device, first.dtype
    eos_ids = eos_ids_of(target, eos_token_id)
    pad_id = pad_token_id if pad_token_id is not None else (getattr(target.config, "pad_token_id", None) or 0)
    threshold = float(opts.draft_threshold) if k else 0.0
    floor = min(float(opts.draft_floor), threshold)
    policy = opts.policy or ("threshold" if opts.temperature and opts.sampling == "rejection" else "goodput")
    if policy == "fixed":
        threshold = floor = 0.0
    processors = make_processors(opts, ids, max_new, eos_ids, vocab, device, tokenizer)
    writer = None
    if trace is not None:
        writer = TraceWriter(trace, layout=layout, strategy=strategy, eos_token_ids=eos_ids, max_new_tokens=max_new,
                             num_requests=len(ids), window=window, num_draft_tokens=k, draft_threshold=threshold,
                             draft_floor=floor)
    settings = Settings(k=k, eos_ids=eos_ids, window=window, dtype=dtype, device=device, fill=mask_fill_value(dtype),
                        pad_id=int(pad_id), observer=observer_for(check_invariants, writer),
                        chooser=make_chooser(opts.temperature, opts.top_k, opts.top_p, opts.seed, opts.sampling,
                                             len(ids), device, request_ids, processors),
                        processors=processors, policy=make_policy(PolicySettings(policy, k, threshold, floor)),
                        backend=for_device(device))
    return settings, writer


class _Results:
    """What comes back while a strategy runs: each request's tokens, stop reason, rounds and finish
    time, passed on to on_result and shown on a progress bar (label None: no bar)."""

    def __init__(self, count: int, on_result, label: str | None):
        self.count, self.on_result, self.rows, self.bar = count, on_result, {}, None
        if label is not None:
            from tqdm import tqdm
            self.bar = tqdm(total=count, desc=label, unit="req", leave=False)
        self.start = time.perf_counter()

    def done(self, stats: Stats, request, tokens, reason, rounds) -> None:
        self.rows[request] = (tokens, reason, rounds, time.perf_counter() - self.start)
        if self.on_result is not None:
            self.on_result(request, tokens, reason, rounds)
        if self.bar is not None:
            self.bar.update(1)
            elapsed = time.perf_counter() - self.start
            tau = stats.generated_tokens / stats.row_rounds if stats.row_rounds else 0.0
            self.bar.set_postfix(tok_s=f"{stats.generated_tokens / elapsed:.1f}", tau=f"{tau:.2f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def result(self, stats: Stats, writer, tokenizer, stops, arrivals) -> GenerationResult:
        """The GenerationResult in input order (S2); the trace's results line written."""
        sequences = [self.rows[r][0] for r in range(self.count)]
        reasons = [self.rows[r][1] for r in range(self.count)]
        if writer is not None:
            writer.results(sequences, reasons)
        texts = [result_text(s, reason, tokenizer, stop) for s, reason, stop in zip(sequences, reasons, stops)] \
            if tokenizer is not None else None
        per_request = [dict(rounds=rounds, accepted_length=len(tokens) / max(rounds, 1),
                            latency=finished - (arrivals[r] if arrivals is not None else 0.0))
                       for r, (tokens, _, rounds, finished) in sorted(self.rows.items())]
        return GenerationResult(sequences, reasons, stats.as_dict(), texts, per_request)
