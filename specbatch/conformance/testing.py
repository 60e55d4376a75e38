"""Check any engine's batch speculative decoding against specbatch's oracle, from Python or pytest.

An engine is a callable

    generate_fn(prompts: list[list[int]], max_new_tokens: list[int], eos_token_ids: list[int],
                batch_size: int) -> list[list[int]]      # new tokens per prompt, in input order

(greedy decoding; the first EOS kept, as transformers and vLLM return it). Adapters for
specbatch's strategies, its deliberately broken variants and transformers' assisted generation are
below; wrap any other engine the same way.

- `check_engine(generate_fn, vectors)`: runs the conformance vectors (specbatch.conformance.greedy) through
  the engine at several batch sizes and orders; raises ConformanceError with the report.
- `find_counterexample(generate_fn, target)`: a Hypothesis search over batch compositions, orders
  and sizes against target-only greedy decoding at batch 1, shrunk to a minimal failing case
  (fewest requests, shortest prompts), printed as a ready-to-paste pytest test.
- `check_processor_engine(generate_fn, vectors)`: the processor vectors (specbatch.conformance.processor_vectors:
  penalties, logit bias and min_tokens at draft positions, mixed settings in one batch) through an
  engine that also takes one settings dict per request; `broken_processor_engine` makes the
  public bug classes (PROCESSOR_BUGS) it must flag.
- The pytest plugin (registered as the `specbatch` entry point of `pytest11`) gives the fixtures
  `specbatch_vectors` (a factory: vectors for a model, cached per session), `specbatch_check_engine`
  and `specbatch_check_sampling` (sampled outputs against the target's distribution).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .greedy import Report, Vectors, check_outputs, load_vectors, make_vectors, reference_outputs
from ..errors import SpecbatchError


class ConformanceError(SpecbatchError, AssertionError):
    """An engine's outputs are not equivalent to target-only decoding; the message lists where."""


# ---------------------------------------------------------------- adapters

def specbatch_engine(target, draft, strategy: str = "ragged", **options):
    """One of specbatch's strategies as an engine."""
    import specbatch

    def generate_fn(prompts, max_new_tokens, eos_token_ids, batch_size):
        return specbatch.generate(target, draft, prompts, max_new_tokens=list(max_new_tokens), batch_size=batch_size,
                                  strategy=strategy, eos_token_id=list(eos_token_ids), **options).sequences
    return generate_fn


def broken_engine(target, draft, variant: str, num_draft_tokens: int = 4):
    """The deliberately broken bsp-like / dsd-like variants (they must be flagged)."""
    from ..api import generate_variant

    def generate_fn(prompts, max_new_tokens, eos_token_ids, batch_size):
        return generate_variant(target, draft, prompts, variant=variant, max_new_tokens=list(max_new_tokens),
                                batch_size=batch_size, eos_token_id=list(eos_token_ids),
                                num_draft_tokens=num_draft_tokens, policy="fixed").sequences
    return generate_fn


def hf_assisted_engine(target, draft=None, prompt_lookup_num_tokens: int | None = None, num_assistant_tokens: int = 4):
    """transformers' assisted generation (draft model, or prompt lookup), one request at a time
    (transformers supports batch 1 only); the batch size is ignored."""
    import torch

    def generate_fn(prompts, max_new_tokens, eos_token_ids, batch_size):
        out = []
        device = next(target.parameters()).device
        for prompt, budget in zip(prompts, max_new_tokens):
            kw = dict(assistant_model=draft) if draft is not None else dict(
                prompt_lookup_num_tokens=prompt_lookup_num_tokens or num_assistant_tokens)
            if draft is not None:
                draft.generation_config.num_assistant_tokens = num_assistant_tokens
                draft.generation_config.num_assistant_tokens_schedule = "constant"
                draft.generation_config.assistant_confidence_threshold = 0.0
            ids = torch.tensor([prompt], device=device)
            with torch.no_grad():
                gen = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget,
                                      do_sample=False, eos_token_id=list(eos_token_ids) or None,
                                      pad_token_id=(list(eos_token_ids) or [0])[0], **kw)
            out.append(cut_at_stop(gen[0, len(prompt):].tolist(), budget, eos_token_ids))
        return out
    return generate_fn


def cut_at_stop(tokens, budget: int, eos_token_ids) -> list:
    """`tokens` cut to `budget` and after the first EOS id (kept): one request's output from an
    engine run with one budget and no EOS for the whole batch."""
    tokens = list(tokens)[:budget]
    stop = next((i for i, t in enumerate(tokens) if t in eos_token_ids), None)
    return tokens[:stop + 1] if stop is not None else tokens


def _left_padded(group, pad_token_id: int, device):
    """(ids [B, W] left-padded with pad_token_id, attention mask [B, W] from the prompts' lengths)."""
    import torch
    width = max(map(len, group))
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in group], device=device)
    lengths = torch.tensor([len(p) for p in group], device=device)
    return ids, torch.arange(width, device=device)[None, :] >= (width - lengths)[:, None]


def padded_batch_engine(target, pad_token_id: int, mask_from_pad: bool = False):
    """transformers' batched greedy `generate` with left padding: requests in batches of
    `batch_size`, each left-padded with `pad_token_id` to its longest prompt, run to its largest
    budget with no EOS, each output cut to its own budget and first EOS (`cut_at_stop`: the recipe
    for engines that take one budget and one EOS id per call).

    The attention mask comes from the prompts' lengths; mask_from_pad=True derives it from
    `token == pad_token_id` instead, the mistake of several published batch implementations (a pad
    id inside a prompt is then hidden too), which the vectors' pad-in-prompt class (and eos-in-prompt,
    where the pad id is an EOS id) must flag."""
    import torch

    def generate_fn(prompts, max_new_tokens, eos_token_ids, batch_size):
        out, device = [], next(target.parameters()).device
        for start in range(0, len(prompts), batch_size):
            group, budgets = prompts[start:start + batch_size], max_new_tokens[start:start + batch_size]
            ids, mask = _left_padded(group, pad_token_id, device)
            width = ids.shape[1]
            if mask_from_pad:
                mask = ids != pad_token_id
            with torch.no_grad():
                gen = target.generate(ids, attention_mask=mask.long(), max_new_tokens=max(budgets),
                                      min_new_tokens=max(budgets), do_sample=False, eos_token_id=None,
                                      pad_token_id=pad_token_id)
            out += [cut_at_stop(row[width:].tolist(), b, eos_token_ids) for row, b in zip(gen, budgets)]
        return out
    return generate_fn


# ---------------------------------------------------------------- vectors through an engine

def _is_token(value) -> bool:
    """A token id as an engine may return it: a Python or NumPy integer, never a bool, float or str."""
    import numbers
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _as_list(value):
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, (list, tuple)) else value


def call_engine(generate_fn, prompts, budgets, eos, batch_size, timeout: float | None):
    """generate_fn's outputs, or ConformanceError if it raises, does not return within `timeout`
    seconds (None: no limit), or returns anything but one list of integer token ids per prompt."""
    if timeout is None:
        got = generate_fn(prompts, budgets, eos, batch_size)
    else:
        import threading
        box: dict = {}

        def run():
            try:
                box["got"] = generate_fn(prompts, budgets, eos, batch_size)
            except BaseException as e:  # reported below, in the caller's thread
                box["error"] = e
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            raise ConformanceError(f"the engine did not return within {timeout:g} s ({len(prompts)} prompts, "
                                   f"batch {batch_size})")
        if "error" in box:
            raise box["error"]
        got = box["got"]
    got = _as_list(got)
    if not isinstance(got, (list, tuple)):
        raise ConformanceError(f"the engine returned {type(got).__name__}, not one token list per prompt")
    if len(got) != len(prompts):
        raise ConformanceError(f"the engine returned {len(got)} outputs for {len(prompts)} prompts")
    return [_as_list(tokens) for tokens in got]


def run_vectors(generate_fn, vectors: Vectors, batch_size: int, order: list[int], timeout: float | None = None
                ) -> list[dict]:
    """The engine's outputs on the vectors, requests submitted in `order`, as rows with id and
    token_ids; ConformanceError naming the request for anything that is not a list of integer ids."""
    eos = vectors.manifest["eos_token_ids"]
    prompts = [vectors.prompts[i] for i in order]
    budgets = [vectors.budgets[i] for i in order]
    rows = []
    for i, tokens in zip(order, call_engine(generate_fn, prompts, budgets, eos, batch_size, timeout)):
        ident = vectors.requests[i]["id"]
        if not isinstance(tokens, (list, tuple)):
            raise ConformanceError(f"request {ident!r}: the engine returned {type(tokens).__name__}, not a token list")
        bad = next((t for t in tokens if not _is_token(t)), None)
        if bad is not None:
            raise ConformanceError(f"request {ident!r}: token {bad!r} ({type(bad).__name__}) is not an integer id")
        rows.append(dict(id=ident, token_ids=[int(t) for t in tokens]))
    return rows


def _vectors_for(vectors) -> Vectors:
    """Vectors from a folder path, loaded Vectors, or a model (vectors are made for it in a temporary folder)."""
    if isinstance(vectors, Vectors):
        return vectors
    if isinstance(vectors, (str, Path)):
        return load_vectors(vectors)
    if hasattr(vectors, "parameters") and hasattr(vectors, "config"):
        import tempfile
        folder = Path(tempfile.mkdtemp(prefix="specbatch-vectors-"))
        make_vectors(vectors, folder)
        return load_vectors(folder)
    raise ConformanceError(f"vectors must be a folder, specbatch.conformance.greedy.Vectors or a model, got "
                           f"{type(vectors).__name__}")


def check_engine(generate_fn, vectors, batch_sizes=None, orders=("input", "shuffled"), ulps=None,
                 timeout: float | None = None) -> list[Report]:
    """Run the vectors (a folder, Vectors, or a model to make them for) at each batch size and order;
    raise ConformanceError naming every algorithmic divergence, and for outputs that are not one list
    of integer token ids per prompt, or a call that takes longer than `timeout` seconds. Returns the reports."""
    vectors = _vectors_for(vectors)
    suggested = vectors.manifest["suggested"]
    reports, failures = [], []
    for batch in batch_sizes or suggested["batch_sizes"]:
        for name in orders:
            outputs = run_vectors(generate_fn, vectors, batch, suggested["orders"][name], timeout)
            report = check_outputs(vectors, outputs, ulps)
            reports.append(report)
            if not report.conformant:
                failures += [f"batch {batch}, {name} order: {line}" for line in report.lines()]
    if failures:
        raise ConformanceError(f"{len(failures)} problem(s):\n" + "\n".join(failures[:20]))
    return reports


# ---------------------------------------------------------------- shrinking search

@dataclass
class Counterexample:
    prompts: list
    max_new_tokens: list
    batch_size: int
    eos_token_ids: list
    expected: list
    got: list

    def as_pytest(self, engine: str = "generate_fn") -> str:
        return (f"def test_specbatch_counterexample():\n"
                f"    prompts = {self.prompts!r}\n"
                f"    max_new_tokens = {self.max_new_tokens!r}\n"
                f"    eos_token_ids = {self.eos_token_ids!r}\n"
                f"    expected = {self.expected!r}  # target-only greedy decoding at batch 1\n"
                f"    # the engine returned {self.got!r}\n"
                f"    assert {engine}(prompts, max_new_tokens, eos_token_ids, batch_size={self.batch_size}) == expected\n")


def find_counterexample(generate_fn, target, *, max_requests: int = 6, max_prompt: int = 16, max_new: int = 12,
                        max_batch: int = 6, max_examples: int = 200, seed: int = 0) -> Counterexample | None:
    """Search batch compositions (prompts, budgets, batch size) for outputs that differ from
    target-only greedy decoding at batch 1, and shrink the first found (Hypothesis): the result has
    as few requests and as short prompts as the search could reach. None if nothing was found.
    Meant for float64 or well-separated models, where every difference is algorithmic."""
    from hypothesis import HealthCheck, Phase, find, settings
    from hypothesis import strategies as st

    from ..fast.models import eos_ids_of, vocab_size
    vocab = vocab_size(target)
    eos = list(eos_ids_of(target))
    case = st.tuples(st.lists(st.tuples(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=max_prompt),
                                        st.integers(1, max_new)), min_size=1, max_size=max_requests),
                     st.integers(1, max_batch))
    memo: dict = {}

    def fails(example) -> bool:
        requests, batch = example
        prompts, budgets = [list(p) for p, _ in requests], [m for _, m in requests]
        key = (repr(prompts), tuple(budgets), batch)
        if key not in memo:
            memo[key] = generate_fn(prompts, budgets, eos, batch) != reference_outputs(target, prompts, budgets, eos)
        return memo[key]

    try:
        requests, batch = find(case, fails, settings=settings(
            max_examples=max_examples, database=None, deadline=None, derandomize=True,
            phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck)), random=None)
    except Exception as e:  # hypothesis.errors.NoSuchExample: the engine passed every case tried
        if type(e).__name__ == "NoSuchExample":
            return None
        raise
    prompts, budgets = [list(p) for p, _ in requests], [m for _, m in requests]
    return Counterexample(prompts, budgets, batch, eos, reference_outputs(target, prompts, budgets, eos),
                          generate_fn(prompts, budgets, eos, batch))


# ---------------------------------------------------------------- sampled engines

def specbatch_sampling_engine(target, draft, sampling: str = "rejection", strategy: str = "ragged", **options):
    """specbatch.generate in one sampling mode ("rejection" or "coupled"), one seed per row."""
    import specbatch

    def sample_fn(prompts, max_new_tokens, eos_token_ids, batch_size, *, temperature, top_k=None, top_p=None,
                  seeds=None, **processors):
        return specbatch.generate(target, draft, prompts, max_new_tokens=list(max_new_tokens), batch_size=batch_size,
                                  strategy=strategy, eos_token_id=list(eos_token_ids), temperature=temperature,
                                  top_k=top_k, top_p=top_p, sampling=sampling, seed=list(seeds), **processors,
                                  **options).sequences
    return sample_fn


def hf_sampling_engine(target, draft=None, num_assistant_tokens: int = 4):
    """transformers' `generate(do_sample=True)`: batched with left padding without a draft (the
    call's first seed seeds torch), or assisted sampling with `draft`, one row at a time (transformers
    assists at batch 1 only), each row seeded with its own seed. Of the processors it expresses
    repetition_penalty, min_p, min_tokens (min_new_tokens) and logit_bias (sequence_bias); SUPPORTS
    lists them."""
    import torch

    def run(ids, mask, budget, eos, kw):
        with torch.no_grad():
            return target.generate(ids, attention_mask=mask, max_new_tokens=budget, do_sample=True,
                                   eos_token_id=list(eos) or None, pad_token_id=(list(eos) or [0])[0], **kw)

    def sample_fn(prompts, max_new_tokens, eos_token_ids, batch_size, *, temperature, top_k=None, top_p=None,
                  seeds=None, repetition_penalty=None, min_p=None, min_tokens=None, logit_bias=None):
        seeds = list(seeds) if seeds is not None else list(range(len(prompts)))
        device = next(target.parameters()).device
        kw = dict(temperature=temperature, top_k=top_k or 0, top_p=top_p if top_p is not None else 1.0)
        if repetition_penalty is not None:
            kw["repetition_penalty"] = repetition_penalty
        if min_p:
            kw["min_p"] = min_p
        if min_tokens:
            kw["min_new_tokens"] = min_tokens
        if logit_bias:
            kw["sequence_bias"] = {(int(t),): float(b) for t, b in logit_bias.items()}
        out = []
        if draft is not None:
            draft.generation_config.num_assistant_tokens = num_assistant_tokens
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            draft.generation_config.assistant_confidence_threshold = 0.0
            for prompt, budget, seed in zip(prompts, max_new_tokens, seeds):
                torch.manual_seed(seed)
                ids = torch.tensor([prompt], device=device)
                gen = run(ids, torch.ones_like(ids), budget, eos_token_ids, dict(kw, assistant_model=draft))
                out.append(cut_at_stop(gen[0, len(prompt):].tolist(), budget, eos_token_ids))
            return out
        for start in range(0, len(prompts), batch_size):
            group, budgets = prompts[start:start + batch_size], max_new_tokens[start:start + batch_size]
            ids, mask = _left_padded(group, 0, device)
            width = ids.shape[1]
            torch.manual_seed(seeds[start])
            gen = run(ids, mask.long(), max(budgets), eos_token_ids, kw)
            out += [cut_at_stop(row[width:].tolist(), b, eos_token_ids) for row, b in zip(gen, budgets)]
        return out
    sample_fn.SUPPORTS = ("repetition_penalty", "min_p", "min_tokens", "logit_bias")
    return sample_fn


def broken_sampling_engine(target, draft, bug: str, num_draft_tokens: int = 4, tree_branches: int | None = None):
    """specbatch.conformance.sampling_engines' textbook sampler with one of its BUGS or TREE_BUGS (they
    must be flagged); a tree bug runs over token trees of 3 candidates per position by default."""
    from .sampling_engines import TREE_BUGS, sampling_engine
    branches = tree_branches or (3 if bug in TREE_BUGS else 1)
    return sampling_engine(target, draft, bug=bug, num_draft_tokens=num_draft_tokens, tree_branches=branches)


def run_sampled(sample_fn, vectors, batch_size: int | None = None, timeout: float | None = None, *,
                skip=(), on_setting=None) -> list[dict]:
    """The engine's continuation of every row of sampled vectors (a folder or SampledVectors): one
    call per setting, its rows in file order, each row's seed passed; rows as dicts (id, token_ids).
    skip: names of settings not to run (already done); on_setting(name, rows) is called as each
    setting's call returns (a caller keeps finished work there)."""
    import functools

    from .sampled import load_sampled_vectors, processor_kwargs
    if isinstance(vectors, (str, Path)):
        vectors = load_sampled_vectors(vectors)
    batch_size = batch_size or vectors.manifest["batch_size"]
    outputs = []
    for s in vectors.settings():
        if s["name"] in skip:
            continue
        rows = vectors.rows_of(s["name"])
        first = len(outputs)
        call = functools.partial(sample_fn, temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"],
                                 seeds=[r["seed"] for r in rows], **processor_kwargs(s))
        got = call_engine(call, [r["token_ids"] for r in rows], [r["max_new_tokens"] for r in rows],
                          vectors.manifest["eos_token_ids"], batch_size, timeout)
        for r, tokens in zip(rows, got):
            if not isinstance(tokens, (list, tuple)) or not all(_is_token(t) for t in tokens):
                raise ConformanceError(f"row {r['id']!r}: the engine did not return a list of integer token ids")
            outputs.append(dict(id=r["id"], token_ids=[int(t) for t in tokens]))
        if on_setting is not None:
            on_setting(s["name"], outputs[first:])
    return outputs


def check_sampling(sample_fn, vectors, target, batch_size: int | None = None, alpha: float | None = None,
                   timeout: float | None = None):
    """Run sampled vectors through the engine and judge its outputs against `target`
    (specbatch.conformance.sampled.check_samples); raise ConformanceError with the report's table and lines
    when it is not conformant. Returns the SampledReport."""
    from .sampled import ALPHA, check_samples, load_sampled_vectors
    if isinstance(vectors, (str, Path)):
        vectors = load_sampled_vectors(vectors)
    vectors, left_out = expressible(vectors, sample_fn)
    outputs = run_sampled(sample_fn, vectors, batch_size, timeout)
    report = check_samples(vectors, outputs, target, batch_size=batch_size, alpha=alpha or ALPHA)
    report.left_out = left_out
    if not report.conformant:
        raise ConformanceError("sampled outputs differ from the target's distribution:\n" + report.table() + "\n"
                               + "\n".join(report.lines()[:20]))
    return report


def expressible(vectors, sample_fn):
    """(the sampled vectors less the settings whose processors the engine cannot express, their
    names): an engine lists what it can in sample_fn.SUPPORTS; one without SUPPORTS takes them all."""
    from .sampled import processor_kwargs
    supports = getattr(sample_fn, "SUPPORTS", None)
    if supports is None:
        return vectors, []
    left_out = [s["name"] for s in vectors.settings() if not set(processor_kwargs(s)) <= set(supports)]
    if not left_out:
        return vectors, []
    return vectors.subset(settings=[s["name"] for s in vectors.settings() if s["name"] not in left_out]), left_out


def sampled_power(sample_fn, target, runs: int = 100, seed: int = 0, group: int = 1, logprobs_from=None,
                  **vector_options) -> list:
    """The sampled checker's reports on `runs` independent runs of an engine: run j draws its
    prompts and row seeds from seed + j (specbatch.conformance.sampled.sampled_vectors, vector_options as
    there); the rows of `group` runs for one setting go to the engine in one call (each run's rows
    fill whole batches, so slots and batches are as in a run of its own; a group helps engines whose
    cost is mostly per call). logprobs_from: a model whose raw log-probabilities the engine returns
    with its tokens (the target for a correct engine, the draft for the class of llama.cpp issue
    27972), and the checker judges them (check_samples(..., logprobs="raw"))."""
    import functools

    from .sampled import check_samples, processor_kwargs, sampled_vectors, token_logprobs
    reports = []
    for first in range(0, runs, group):
        sets = [sampled_vectors(target, seed=seed + first + j, **vector_options)
                for j in range(min(group, runs - first))]
        outputs: list = [[] for _ in sets]
        for s in sets[0].settings():
            rows = [v.rows_of(s["name"]) for v in sets]
            flat = [r for part in rows for r in part]
            call = functools.partial(sample_fn, temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"],
                                     seeds=[r["seed"] for r in flat], **processor_kwargs(s))
            got = iter(call_engine(call, [r["token_ids"] for r in flat], [r["max_new_tokens"] for r in flat],
                                   sets[0].manifest["eos_token_ids"], sets[0].manifest["batch_size"], None))
            for j, part in enumerate(rows):
                outputs[j] += [dict(id=r["id"], token_ids=[int(t) for t in next(got)]) for r in part]
        if logprobs_from is not None:
            for v, out in zip(sets, outputs):
                prompts = {r["id"]: r["token_ids"] for r in v.rows}
                numbers = token_logprobs(logprobs_from, [prompts[o["id"]] for o in out], [o["token_ids"] for o in out])
                for o, values in zip(out, numbers):
                    o["logprobs"] = values.tolist()
        reports += [check_samples(v, out, target, logprobs="raw" if logprobs_from is not None else None)
                    for v, out in zip(sets, outputs)]
    return reports


def toy_sampling_pair(vocab: int = 64, width: int = 16, seed: int = 0, draft_noise: float = 0.6, scale: float = 3.0,
                      logit_offset: float = 24.0):
    """(target, draft): tiny neural LMs whose next token depends on the last two tokens, with peaked
    distributions and logits offset into the range of real models' (where bfloat16 rounds by
    1/16 to 1/8); the draft's context embeddings are the target's plus noise. Cheap enough to draw
    thousands of samples per second: the models of the sampled checker's power simulations."""
    import torch
    import transformers
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(vocab * vocab, width, generator=gen, dtype=torch.float64)
    head = torch.randn(vocab, width, generator=gen, dtype=torch.float64) * (scale / width ** 0.5)
    noise = torch.randn(vocab * vocab, width, generator=gen, dtype=torch.float64) * draft_noise
    config = transformers.PretrainedConfig(vocab_size=vocab, eos_token_id=vocab - 1, max_position_embeddings=4096)
    return (_ContextLM(config, embed, head, logit_offset), _ContextLM(config, embed + noise, head, logit_offset))


class _ContextLM(__import__("torch").nn.Module):
    def __init__(self, config, embed, head, offset):
        import torch
        super().__init__()
        self.config, self.offset = config, offset
        self.embed = torch.nn.Embedding.from_pretrained(embed)
        self.lm_head = torch.nn.Linear(embed.shape[1], head.shape[0], bias=False, dtype=embed.dtype)
        self.lm_head.weight.data.copy_(head)
        self.generation_config = __import__("transformers").GenerationConfig(eos_token_id=config.eos_token_id)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, logits_to_keep=0, **kwargs):
        """Logits [B, T, V] from (token two back, last token); a masked position reads as token 0.
        logits_to_keep: as in transformers (an int keeps the last positions; a 1-D tensor, those)."""
        import torch
        from types import SimpleNamespace
        ids = input_ids if attention_mask is None else input_ids * attention_mask
        context = torch.nn.functional.pad(ids, (1, 0))[:, :-1] * self.config.vocab_size + ids
        if isinstance(logits_to_keep, torch.Tensor):
            context = context[:, logits_to_keep]
        elif logits_to_keep:
            context = context[:, -logits_to_keep:]
        return SimpleNamespace(logits=self.lm_head(self.embed(context)) + self.offset)


# ---------------------------------------------------------------- pytest plugin

def _plugin():
    import pytest

    @pytest.fixture(scope="session")
    def specbatch_vectors(tmp_path_factory):
        """factory(model, tokenizer=None, **make_options) -> Vectors, made once per model per session."""
        made: dict = {}

        def factory(model, tokenizer=None, **options):
            if id(model) not in made:
                folder = tmp_path_factory.mktemp("specbatch-vectors")
                make_vectors(model, folder, tokenizer=tokenizer, **options)
                made[id(model)] = load_vectors(folder)
            return made[id(model)]
        return factory

    @pytest.fixture()
    def specbatch_check_engine():
        """check_engine(generate_fn, vectors, ...) (specbatch.conformance.testing.check_engine)."""
        return check_engine

    @pytest.fixture()
    def specbatch_check_sampling():
        """check_sampling(sample_fn, vectors, target, ...) (specbatch.conformance.testing.check_sampling);
        vectors: a folder, or specbatch.conformance.sampled.sampled_vectors(target) in memory."""
        return check_sampling

    return specbatch_vectors, specbatch_check_engine, specbatch_check_sampling


specbatch_vectors, specbatch_check_engine, specbatch_check_sampling = (
    _plugin() if __import__("importlib").util.find_spec("pytest") else (None, None, None))


# ---------------------------------------------------------------- processors (specbatch.conformance.processor_vectors)

def specbatch_processor_engine(target, draft, strategy: str = "ragged", **options):
    """One of specbatch's strategies as an engine of the processor protocol (settings per request)."""
    import specbatch
    from ..options import defaults
    from .processor_vectors import SETTING_KEYS

    def generate_fn(prompts, max_new_tokens, eos_token_ids, batch_size, settings):
        keys = [key for key in SETTING_KEYS if any(key in s for s in settings)]
        per_prompt = {key: [s.get(key, getattr(defaults(), key)) for s in settings] for key in keys}
        return specbatch.generate(target, draft, prompts, max_new_tokens=list(max_new_tokens), batch_size=batch_size,
                                  strategy=strategy, eos_token_id=list(eos_token_ids), **per_prompt,
                                  **options).sequences
    return generate_fn


PROCESSOR_BUGS = {
    "bonus-only": "processors applied to each row's last verify query only, never at draft positions "
                  "(vllm-project/vllm issue 42744)",
    "per-step": "penalties and min_tokens fed one token per round instead of every accepted token "
                "(sgl-project/sglang PR 33643)",
    "drafts-ignored": "penalties at every verify query count the committed tokens only, not the drafts before it",
    "min-tokens-off-by-one": "EOS held back until min_tokens - 1 new tokens (vllm-project/vllm PR 41768's class)",
    "row-zero-settings": "the first request's settings applied to every row (NVIDIA/TensorRT-LLM PR 12588's class)",
    "stop-window-round-only": "stop strings looked for in the current round's tokens only, so one that spans two "
                              "rounds is missed (the stop-window class of vllm-project/vllm PR 47616)",
    "stop-tokens-kept": "a stop string found inside an accepted block, but the block's tokens after it returned "
                        "(sgl-project/sglang PR 23802, huggingface/transformers issue 48039)",
}


def _broken_processors(bug: str):
    """specbatch.fast.processors.LogitProcessors with one named bug (PROCESSOR_BUGS)."""
    import torch

    from ..fast.processors import LogitProcessors
    if bug not in PROCESSOR_BUGS:
        raise ValueError(f"unknown processor bug {bug!r}; expected one of {', '.join(PROCESSOR_BUGS)}")

    class Broken(LogitProcessors):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            if bug == "min-tokens-off-by-one":
                self.min_tokens = (self.min_tokens - 1).clamp(min=0)
            if bug == "row-zero-settings":
                for name in ("repetition", "presence", "frequency", "min_tokens"):
                    getattr(self, name)[:] = getattr(self, name)[0].clone()
                self.penalized = True

        def process(self, logits, requests, drafted=None):
            if bug == "bonus-only" and logits.dim() == 3:
                out = logits.to(torch.float64, copy=True)
                out[:, -1] = super().process(logits, requests, drafted)[:, -1]
                return out
            return super().process(logits, requests, None if bug == "drafts-ignored" else drafted)

        def finish_round(self, requests, choice, n, hit):
            if bug == "per-step":
                last = choice.gather(1, torch.as_tensor(n - 1, device=choice.device)[:, None])
                super().finish_round(requests, last, n * 0 + 1, hit)
                return n, hit
            if bug == "stop-window-round-only":  # judged on an empty history: this round's tokens alone
                kept, self.host_history = self.host_history, [[] for _ in self.host_history]
                n, hit = super().finish_round(requests, choice, n, hit)
                for r, new in enumerate(self.host_history):
                    kept[r] += new
                self.host_history = kept
                return n, hit
            if bug == "stop-tokens-kept":  # the stop reason kept, the cut undone
                _, hit = super().finish_round(requests, choice, n, hit)
                return n, hit
            return super().finish_round(requests, choice, n, hit)
    return Broken


def _with(processors_class, engine):
    """engine, run with api.LogitProcessors replaced by processors_class for each call."""
    from .. import api

    def run(*args, **kw):
        real, api.LogitProcessors = api.LogitProcessors, processors_class
        try:
            return engine(*args, **kw)
        finally:
            api.LogitProcessors = real
    return run


def broken_processor_engine(target, draft, bug: str, strategy: str = "ragged", **options):
    """specbatch with one named processor bug (PROCESSOR_BUGS): the processor checker must flag it."""
    return _with(_broken_processors(bug), specbatch_processor_engine(target, draft, strategy, **options))


def broken_processor_sampling_engine(target, draft, bug: str, sampling: str = "rejection", **options):
    """specbatch sampling (the sampled protocol) with one named processor bug (PROCESSOR_BUGS)."""
    return _with(_broken_processors(bug), specbatch_sampling_engine(target, draft, sampling, **options))


def hf_assisted_processor_engine(target, draft=None, num_assistant_tokens: int = 4):
    """transformers' assisted generation with the processors transformers has: repetition_penalty,
    min_new_tokens, sequence_bias (logit_bias); presence and frequency penalties it has not
    (SUPPORTS lists what it can express)."""
    import torch

    def generate_fn(prompts, max_new_tokens, eos_token_ids, batch_size, settings):
        out = []
        device = next(target.parameters()).device
        for prompt, budget, s in zip(prompts, max_new_tokens, settings):
            kw = dict(assistant_model=draft) if draft is not None else dict(prompt_lookup_num_tokens=num_assistant_tokens)
            if draft is not None:
                draft.generation_config.num_assistant_tokens = num_assistant_tokens
                draft.generation_config.num_assistant_tokens_schedule = "constant"
                draft.generation_config.assistant_confidence_threshold = 0.0
            if s.get("logit_bias"):
                kw["sequence_bias"] = {(int(t),): float(b) for t, b in s["logit_bias"].items()}
            ids = torch.tensor([prompt], device=device)
            with torch.no_grad():
                gen = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget, do_sample=False,
                                      eos_token_id=list(eos_token_ids) or None,
                                      pad_token_id=(list(eos_token_ids) or [0])[0],
                                      repetition_penalty=s.get("repetition_penalty", 1.0),
                                      min_new_tokens=s.get("min_tokens", 0), **kw)
            out.append(cut_at_stop(gen[0, len(prompt):].tolist(), budget, eos_token_ids))
        return out
    generate_fn.SUPPORTS = ("repetition_penalty", "logit_bias", "min_tokens")
    return generate_fn


def check_processor_engine(generate_fn, vectors, batch_sizes=(1, 4, None), ulps=None) -> list:
    """Run the processor vectors (specbatch.conformance.processor_vectors; or a model to make them for) at each
    batch size (None: every request in one batch); ConformanceError naming every algorithmic
    divergence. Requests whose settings the engine cannot express (generate_fn.SUPPORTS, when it has
    one) are left out and listed in each report's warnings. Returns the reports."""
    from .processor_vectors import ProcessorVectors, check_processor_outputs, make_processor_vectors
    vectors = vectors if isinstance(vectors, ProcessorVectors) else make_processor_vectors(vectors)
    supports = set(getattr(generate_fn, "SUPPORTS", ()) or ())
    keep = [r for r in vectors.requests if not supports or set(r["settings"]) <= supports]
    subset = ProcessorVectors(vectors.manifest, keep, {r["id"]: vectors.reference[r["id"]] for r in keep})
    left_out = [r["id"] for r in vectors.requests if r not in keep]
    reports, failures = [], []
    for batch in batch_sizes:
        size = batch or len(keep)
        eos = list(vectors.manifest["eos_token_ids"])
        got = call_engine(lambda p, m, e, b: generate_fn(p, m, e, b, [dict(r["settings"]) for r in keep]),
                          [r["token_ids"] for r in keep], [r["max_new_tokens"] for r in keep], eos, size, None)
        report = check_processor_outputs(subset, [dict(id=r["id"], token_ids=_as_list(t)) for r, t in zip(keep, got)],
                                         ulps)
        if left_out:
            report.warnings.append(f"{len(left_out)} request(s) use settings the engine cannot express, left out: "
                                   f"{', '.join(left_out[:5])}{' ...' if len(left_out) > 5 else ''}")
        reports.append(report)
        if not report.conformant:
            failures += [f"batch {size}: {line}" for line in report.lines()]
    if failures:
        raise ConformanceError(f"{len(failures)} problem(s):\n" + "\n".join(failures[:20]))
    return reports


# ---------------------------------------------------------------- seeded reproducibility

def check_seeded_reproducibility(sample_fn, prompts, *, max_new_tokens: int = 8, eos_token_ids=(),
                                 temperature: float = 0.8, top_k=None, top_p=None, seeds=None, batch_size=None,
                                 speculation_off=None) -> dict:
    """Seeded determinism, a verdict of its own (not every engine promises it): each request, with
    its own seed, must give the same tokens alone, in one batch with the others, in that batch in
    reverse order, and, when `speculation_off` (the same engine, speculation off) is given, without
    speculation. sample_fn follows the sampled protocol (run_sampled). Returns dict(reproducible,
    differences: [(request, what, tokens, other tokens)])."""
    seeds = list(seeds) if seeds is not None else [1000 + i for i in range(len(prompts))]
    size = batch_size or len(prompts)
    budgets, eos = [max_new_tokens] * len(prompts), list(eos_token_ids)

    def run(fn, order, batch):
        got = fn([prompts[i] for i in order], [budgets[i] for i in order], eos, batch, temperature=temperature,
                 top_k=top_k, top_p=top_p, seeds=[seeds[i] for i in order])
        return {i: _as_list(t) for i, t in zip(order, got)}

    together = run(sample_fn, list(range(len(prompts))), size)
    runs = {"alone": {i: run(sample_fn, [i], 1)[i] for i in range(len(prompts))},
            "reversed batch": run(sample_fn, list(range(len(prompts)))[::-1], size)}
    if speculation_off is not None:
        runs["speculation off"] = run(speculation_off, list(range(len(prompts))), size)
    differences = [(i, what, together[i], other[i]) for what, other in runs.items() for i in range(len(prompts))
                   if other[i] != together[i]]
    return dict(reproducible=not differences, differences=differences)
