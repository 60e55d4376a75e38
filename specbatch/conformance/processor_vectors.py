"""Greedy conformance vectors with logit processors: penalties, logit bias and min_tokens at draft
positions, in one mixed batch.

Penalties, biases, min_tokens and stop strings keep greedy decoding deterministic, so an engine with
speculation on must return exactly target-only greedy decoding with the same processors
(reference.processors, whose order docs/api.md#processors states). Every request is chosen so that
its processors matter where speculation can get them wrong: the processed answer differs from the
unprocessed one at a draft position of the first round (new token 1 .. ROUND - 1), an EOS that a
logit bias makes likely is held back by min_tokens, or (with a tokenizer) a stop string of two
tokens completes in the middle of the first round's tokens, or across the first two rounds; the
output then ends at the token that completes it. All requests go to the engine together, so rows with different
settings, and rows that cannot draft (a budget of 1), share batches. An engine is

    generate_fn(prompts, max_new_tokens, eos_token_ids, batch_size, settings) -> list[list[int]]

with settings one dict per request (keys SETTING_KEYS; an absent key is the default). The reference
keeps the processed top logits along each answer, so a divergence is judged a floating-point tie or
algorithmic as in specbatch.conformance.greedy.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .greedy import ROUND, TOP, Report, VectorError, _default_ulps, judge, judge_logprobs, model_identity
from ..reference.processors import PROCESSOR_SETTINGS, Processors, process_logits, processed_greedy_decode, stop_text

FORMAT, VERSION = "specbatch-processors", 1
SETTING_KEYS = tuple(k for k in PROCESSOR_SETTINGS if k != "min_p")  # min_p never changes a greedy choice
CLASSES = ("repetition-in-round", "frequency-in-round", "presence-in-round", "bias-in-round", "min-tokens-eos", "mixed")
STOP_CLASSES = ("stop-in-round", "stop-across-rounds")  # with a tokenizer
STOP_SPANS = {"stop-in-round": (1, 3), "stop-across-rounds": (ROUND - 1, ROUND + 1)}  # new tokens of the stop string


@dataclass
class ProcessorVectors:
    manifest: dict
    requests: list  # id, class, token_ids, max_new_tokens, settings
    reference: dict  # id -> dict(token_ids, top: per answer position [[token, processed logit], ...])

    @property
    def prompts(self):
        return [r["token_ids"] for r in self.requests]


def processors_of(settings: dict) -> Processors:
    convert = {"logit_bias": lambda v: {int(t): float(b) for t, b in v.items()}, "stop": tuple}
    return Processors(**{key: convert.get(key, lambda v: v)(value) for key, value in settings.items()})


def _logits_fn(target):
    """ids -> the target's logits [T, V] (float64) at every position; a call that extends the previous
    call's ids by one token runs that token alone on the kept cache, as greedy decoding does."""
    import torch
    from transformers import DynamicCache

    from ..fast.models import cache_argument
    keyword, last = cache_argument(target), {}

    def logits_of(ids):
        ids = [int(t) for t in ids]
        device = next(target.parameters()).device
        extends = last.get("ids") is not None and len(ids) == len(last["ids"]) + 1 and ids[:-1] == last["ids"]
        cache = last["cache"] if extends else DynamicCache()
        with torch.inference_mode():
            out = target(torch.tensor([ids[-1:] if extends else ids], device=device), use_cache=True, **{keyword: cache})
        logits = out.logits[0].double().cpu().numpy()
        logits = np.concatenate([last["logits"], logits]) if extends else logits
        last.update(ids=ids, cache=cache, logits=logits)
        return logits
    return logits_of


def _reference_scores(logits_of, prompt, answer, proc: Processors, eos) -> tuple[list, dict]:
    """(top: [[token, processed logit] x TOP] at every answer position; logprobs: the answer token's
    log-probability at every position, raw (the target's) and processed), from one forward."""
    if not answer:
        return [], dict(raw=[], processed=[])
    logits = logits_of(list(prompt) + list(answer[:-1]))[len(prompt) - 1:]
    top, raw, processed = [], [], []
    for j, row in enumerate(logits):
        x = process_logits(row, prompt, answer[:j], proc, eos)
        order = np.argsort(-x, kind="stable")[:TOP]
        top.append([[int(t), float(x[t])] for t in order])
        raw.append(float(_log_softmax(row)[answer[j]]))
        processed.append(float(_log_softmax(x)[answer[j]]))
    return top, dict(raw=raw, processed=processed)


def _log_softmax(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def _settings_for(cls: str, rng) -> dict:
    if cls == "repetition-in-round":
        return dict(repetition_penalty=float(rng.choice([1.3, 1.6, 2.0])))
    if cls == "frequency-in-round":
        return dict(frequency_penalty=float(rng.choice([0.5, 1.0, 2.0])))
    if cls == "presence-in-round":
        return dict(presence_penalty=float(rng.choice([0.5, 1.0, 2.0])))
    return dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5)


def _flip_at(logits_of, prompt, answer, j: int) -> dict:
    """A logit bias that makes the runner-up the argmax at new token j (and a penalty on another token)."""
    x = logits_of(list(prompt) + list(answer[:j]))[-1]
    top, second = np.argsort(-x, kind="stable")[:2]
    return {int(second): float(min(x[top] - x[second] + 0.5, 100.0)), int(np.argsort(x)[0]): -3.0}


def _stop_strings(logits_of, prompts, plain, cls: str, decode, eos, max_new_tokens: int, count: int) -> list:
    """Up to `count` (prompt, stop string) pairs: the decoding of the plain answer's new tokens
    STOP_SPANS[cls], a string of two tokens neither of which holds it alone, which processed greedy
    decoding completes at the span's last token and not before."""
    start, end = STOP_SPANS[cls]
    found = []
    for prompt, answer in zip(prompts, plain):
        stop = decode(answer[start:end]) if len(answer) > end else ""
        if not stop.strip() or any(stop in decode([t]) for t in answer[start:end]):
            continue
        got = processed_greedy_decode(logits_of, prompt, max_new_tokens, Processors(stop=(stop,)), eos, decode)
        if len(got) == end:
            found.append((prompt, stop))
            if len(found) == count:
                break
    return found


def make_processor_vectors(target, *, tokenizer=None, seed: int = 0, candidates: int = 16, per_class: int = 3,
                           max_new_tokens: int = 12) -> ProcessorVectors:
    """Vectors for `target` (in memory): per_class requests of every class, each picked among
    `candidates` random prompts where its processors change the answer inside the first round; with
    `tokenizer`, the stop-string classes too (text decoded without special tokens)."""
    from ..fast.models import eos_ids_of
    rng = np.random.default_rng(seed)
    identity = model_identity(target)
    vocab, eos = identity["vocab_size"], [int(e) for e in eos_ids_of(target)]
    logits_of = _logits_fn(target)
    prompts = [rng.integers(0, vocab, int(rng.integers(3, 20))).tolist() for _ in range(candidates)]
    plain = [processed_greedy_decode(logits_of, p, max_new_tokens, Processors(), eos) for p in prompts]
    requests: list[dict] = []

    def add(cls, prompt, budget, settings):
        requests.append(dict(id=f"{cls}-{sum(r['class'] == cls for r in requests)}", **{"class": cls},
                             token_ids=list(prompt), max_new_tokens=budget, settings=settings))

    for cls in CLASSES[:4]:
        found = 0
        for prompt, answer in zip(prompts, plain):
            if cls == "bias-in-round" and len(answer) < 3:
                continue
            settings = (dict(logit_bias=_flip_at(logits_of, prompt, answer, 2)) if cls == "bias-in-round"
                        else _settings_for(cls, rng))
            got = processed_greedy_decode(logits_of, prompt, max_new_tokens, processors_of(settings), eos)
            first = next((j for j, (a, b) in enumerate(zip(got, answer)) if a != b), None)
            if first is not None and 1 <= first < ROUND:  # a draft position of the first round
                add(cls, prompt, max_new_tokens, settings)
                found += 1
                if found == per_class:
                    break
    if eos:  # a bias that makes EOS the argmax at new token 1, held back by min_tokens until token 3
        for prompt in prompts[:per_class]:
            x = logits_of(prompt + processed_greedy_decode(logits_of, prompt, 1, Processors(), eos))[-1]
            bias = float(min(x.max() - x[eos[0]] + 1.0, 100.0))
            add("min-tokens-eos", prompt, max_new_tokens, dict(logit_bias={eos[0]: bias}, min_tokens=3))
    decode = None if tokenizer is None else (lambda tokens: tokenizer.decode(list(tokens), skip_special_tokens=True))
    if tokenizer is not None:
        for cls in STOP_CLASSES:
            for prompt, stop in _stop_strings(logits_of, prompts, plain, cls, decode, eos, max_new_tokens, per_class):
                add(cls, prompt, max_new_tokens, dict(stop=[stop]))
    mixed = [dict(), dict(repetition_penalty=1.5), dict(frequency_penalty=1.0, min_tokens=2),
             dict(presence_penalty=1.5), dict(repetition_penalty=1.8, presence_penalty=0.5)]
    for i, settings in enumerate(mixed * 2):  # every setting beside the others, with and without a budget of 1
        one = i % 3 == 2 and "min_tokens" not in settings
        add("mixed", prompts[i % len(prompts)], 1 if one else max_new_tokens, settings)
    reference = {r["id"]: _reference_answer(logits_of, r, eos, decode) for r in requests}
    classes = list(CLASSES) + (list(STOP_CLASSES) if tokenizer is not None else [])
    manifest = dict(format=FORMAT, version=VERSION, **identity, eos_token_ids=eos, num_requests=len(requests),
                    classes=classes, seed=seed, tie_ulps_default=_default_ulps(identity["dtype"]),
                    tokenizer=tokenizer_identity(tokenizer) if tokenizer is not None else None,
                    logprobs="each answer token's log-probability, raw (the target's log-softmax) and processed "
                             "(after the request's processors): conform check --logprobs raw|processed",
                    order="logit_bias, min_tokens, repetition_penalty, presence and frequency penalties "
                          "(docs/api.md#processors)")
    return ProcessorVectors(manifest, requests, reference)


def _reference_answer(logits_of, request: dict, eos, decode) -> dict:
    """A request's reference: greedy decoding with its processors, each answer token's top logits and
    raw and processed logprobs, and with a stop string the text before it."""
    proc = processors_of(request["settings"])
    answer = processed_greedy_decode(logits_of, request["token_ids"], request["max_new_tokens"], proc, eos, decode)
    top, logprobs = _reference_scores(logits_of, request["token_ids"], answer, proc, eos)
    row = dict(id=request["id"], token_ids=answer, top=top, logprobs=logprobs)
    if proc.stop:
        row["text"] = stop_text(decode(answer), proc.stop)
    return row


def tokenizer_identity(tokenizer) -> dict:
    """The tokenizer's class and a SHA-256 of its vocabulary: stop strings are judged on its text."""
    import hashlib
    import json
    vocab = json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]))
    return dict(tokenizer_class=type(tokenizer).__name__, vocab_sha256=hashlib.sha256(vocab.encode()).hexdigest())


def save_processor_vectors(vectors: ProcessorVectors, path) -> None:
    """One JSON file: manifest, requests (logit_bias keys as strings), reference."""
    import json
    Path(path).write_text(json.dumps(dict(manifest=vectors.manifest, requests=vectors.requests,
                                          reference=vectors.reference)) + "\n")


def load_processor_vectors(path) -> ProcessorVectors:
    if _format_of(path) != FORMAT:
        raise VectorError(f"{path}: not processor vectors (format {FORMAT!r})")
    import json
    data = json.loads(Path(path).read_text())
    for r in data["requests"]:
        if "logit_bias" in r["settings"]:
            r["settings"]["logit_bias"] = {int(t): float(b) for t, b in r["settings"]["logit_bias"].items()}
    return ProcessorVectors(data["manifest"], data["requests"], data["reference"])


def is_processor_vectors(path) -> bool:
    """Whether `path` is a file of processor vectors (save_processor_vectors)."""
    return Path(path).is_file() and _format_of(path) == FORMAT


def _format_of(path) -> str | None:
    import json
    try:
        return json.loads(Path(path).read_text()).get("manifest", {}).get("format")
    except (OSError, ValueError, AttributeError):
        return None


def without(vectors: ProcessorVectors, settings: str) -> ProcessorVectors:
    """The vectors less the requests that use any of `settings` (comma-separated names)."""
    names = set(filter(None, (settings or "").split(",")))
    unknown = names - set(SETTING_KEYS)
    if unknown:
        raise VectorError(f"--without: unknown setting {sorted(unknown)[0]!r}; expected some of {', '.join(SETTING_KEYS)}")
    keep = [r for r in vectors.requests if not set(r["settings"]) & names]
    return ProcessorVectors(vectors.manifest, keep, {r["id"]: vectors.reference[r["id"]] for r in keep})


def run_processor_vectors(generate_fn, vectors: ProcessorVectors, batch_size: int) -> list[dict]:
    """The engine's outputs for every request, submitted together in file order."""
    requests = vectors.requests
    got = generate_fn([r["token_ids"] for r in requests], [r["max_new_tokens"] for r in requests],
                      list(vectors.manifest["eos_token_ids"]), batch_size, [dict(r["settings"]) for r in requests])
    if not isinstance(got, list) or len(got) != len(requests):
        raise ValueError(f"the engine returned {type(got).__name__} of {len(got) if hasattr(got, '__len__') else '?'} "
                         f"answers for {len(requests)} requests")
    return [dict(id=r["id"], token_ids=[int(t) for t in tokens]) for r, tokens in zip(requests, got)]


def check_processor_outputs(vectors: ProcessorVectors, outputs, ulps: float | None = None, logprobs: str | None = None,
                            tolerance: float | None = None) -> Report:
    """Each output against target-only greedy decoding with its request's processors. logprobs: "raw"
    or "processed" also checks the log-probability the engine returned for each token it shares with
    the reference (an output's `logprobs`, one number per token, or `top`, [[token, logprob], ...] per
    token) against the reference's, within `tolerance` (default: the tie tolerance of the dtype's
    logprobs, conform.logprob_tolerance)."""
    from .greedy import logprob_tolerance
    dtype = vectors.manifest["dtype"]
    ulps = vectors.manifest["tie_ulps_default"] if ulps is None else ulps
    if logprobs not in (None, "raw", "processed"):
        raise VectorError(f"logprobs must be 'raw' or 'processed', got {logprobs!r}")
    tolerance = logprob_tolerance(dtype, ulps) if tolerance is None else tolerance
    by_id = {str(o["id"]): o for o in outputs}
    report = Report()
    report.extra = sorted(i for i in by_id if i not in vectors.reference)
    for r in vectors.requests:
        base = dict(id=r["id"], **{"class": r["class"]})
        if r["id"] not in by_id:
            report.missing.append(r["id"])
            report.requests.append(dict(base, verdict="missing"))
        else:
            verdict = judge(vectors.reference[r["id"]], list(by_id[r["id"]]["token_ids"]), dtype, ulps)
            if logprobs and verdict["verdict"] != "algorithmic":
                verdict = judge_logprobs(vectors.reference[r["id"]], by_id[r["id"]], logprobs, tolerance,
                                          report.warnings) or verdict
            report.requests.append(dict(base, **verdict))
    return report
