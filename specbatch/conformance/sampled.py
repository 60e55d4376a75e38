"""Sampled conformance: vectors with sampling settings, and a goodness-of-fit checker of stated power.

`make_sampled_vectors(target, out_dir)` writes

    manifest.json   format "specbatch-sampled": the model's identity, the EOS ids, the settings, the
                    batch size to submit with, the false-alarm rate, the SHA-256 of rows.jsonl
    rows.jsonl      one line per sample to draw, in submission order: id, setting, request, sample,
                    token_ids, max_new_tokens, eos_token_ids, temperature, top_k, top_p, seed

Each setting's rows are submitted together, in file order. Within a setting, rows come in twins
(two copies of one request, adjacent) and the layout repeats every `batch_size` rows, so a static
batcher puts a request at the same slot in consecutive batches.

`check_samples(vectors, outputs, target)` judges an engine's continuations against the target's
own sampling distribution, under the reference semantics: divide the logits by the temperature,
keep the top-k (ties kept), then the smallest most-likely set whose mass reaches top-p, renormalise.
Its parts, each with an exact or asymptotically exact null (proofs_notes/sampled_checker.md):

  support       a token the settings exclude (beyond a rounding slack) never comes from the target;
  tree          wherever NODE_MIN or more samples of a request share a prefix, their next tokens are
                a multinomial sample of the target's conditional there: Pearson's chi-square (cells
                of expected count >= 5), summed over the nodes of a setting;
  rank          every other token's randomized PIT (tokens ordered by descending probability) is
                uniform given its prefix: chi-square over PIT_BINS equal bins, per setting;
  tail          every token's randomized PIT (big nodes too) lies in its least likely TAIL_MASS with
                probability TAIL_MASS, independently: the exact binomial tail of how many do, pooled
                over the settings (sensitive to a few tokens the target almost never draws, which
                the tree test's rest cell and the rank test's bins dilute);
  independence  twins (one batch) and slot pairs (one slot, consecutive batches) are independent
                draws: the exact Poisson-binomial tail of the number of identical continuations.

The verdict rejects when a support violation is found or any p-value is below alpha divided by
their number (Bonferroni): the false-alarm rate is at most alpha, 0.001 by default.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .greedy import (VectorError, _is_int, _jsonl, _token_list, check_manifest_digest, file_digest, manifest_digest,
                      model_identity)
from ..reference.processors import PROCESSOR_SETTINGS

FORMAT, VERSION = "specbatch-sampled", 2  # 2: the manifest's digest of the fields that decide verdicts
DECISIVE = ("format", "version", "model_class", "config_sha256", "weights_sha256", "dtype", "vocab_size",
            "eos_token_ids", "settings", "samples", "requests_per_setting", "max_new_tokens", "batch_size", "alpha",
            "num_rows", "checksums")
ALPHA = 0.001
NODE_MIN = 25  # samples sharing a prefix before their next tokens are tested as one multinomial
CELL_MIN = 5.0  # Cochran's rule: expected count of every chi-square cell
PIT_BINS = 10
SLACK = 1e-3  # rounding slack at the top-k and top-p boundaries (relative logit, and mass)
TAIL_MASS = 1e-3  # the tail test counts tokens whose randomized PIT exceeds 1 - TAIL_MASS
PROCESSOR_KEYS = tuple(k for k in PROCESSOR_SETTINGS if k != "stop")  # stop strings: the greedy processor vectors
SETTINGS = (  # temperature below and above 1, top-k, top-p and their combinations
    dict(name="t0.7", temperature=0.7, top_k=None, top_p=None),
    dict(name="t1.3", temperature=1.3, top_k=None, top_p=None),
    dict(name="t1.0-k5", temperature=1.0, top_k=5, top_p=None),
    dict(name="t0.8-p0.8", temperature=0.8, top_k=None, top_p=0.8),
    dict(name="t1.3-p0.7", temperature=1.3, top_k=None, top_p=0.7),
    dict(name="t0.7-k10-p0.8", temperature=0.7, top_k=10, top_p=0.8),
)


# ---------------------------------------------------------------- vectors

def processor_settings(target, prompts, eos_token_ids) -> tuple:
    """Sampled settings with logit processors (reference.processors), each combining only settings
    whose order engines agree on: penalties with the temperature, min_p with the temperature and
    top-k (min_p commutes with top-k, not with top-p, which vLLM and transformers order differently),
    a logit bias that makes the first prompt's fourth most likely token its most likely one, and,
    with an EOS id, a bias that makes EOS likely held back by min_tokens for three tokens."""
    import torch
    device = next(target.parameters()).device
    with torch.inference_mode():
        x = target(input_ids=torch.tensor([list(prompts[0])], device=device)).logits[0, -1].double().cpu().numpy()
    order = np.argsort(-x, kind="stable")
    settings = [dict(name="t1.0-rep1.5", temperature=1.0, top_k=None, top_p=None, repetition_penalty=1.5),
                dict(name="t0.8-freq1-pres0.5", temperature=0.8, top_k=None, top_p=None, frequency_penalty=1.0,
                     presence_penalty=0.5),
                dict(name="t1.0-minp0.1", temperature=1.0, top_k=None, top_p=None, min_p=0.1),
                dict(name="t0.7-k20-minp0.05", temperature=0.7, top_k=20, top_p=None, min_p=0.05),
                dict(name="t1.0-bias", temperature=1.0, top_k=None, top_p=None,
                     logit_bias={int(order[3]): round(float(x[order[0]] - x[order[3]]) + 0.5, 3), int(order[0]): -2.0})]
    if eos_token_ids:
        eos = int(eos_token_ids[0])
        settings.append(dict(name="t1.0-min-tokens3", temperature=1.0, top_k=None, top_p=None, min_tokens=3,
                             logit_bias={eos: round(float(x.max() - x[eos]) + 1.0, 3)}))
    return tuple(settings)


def _repeating_prompts(target, rng, count: int, max_new_tokens: int, vocab: int, candidates: int = 32) -> list:
    """`count` of `candidates` random prompts (3 to 16 ids), those whose greedy continuation repeats
    one of its own tokens soonest: where penalties change the distribution inside a round's drafts."""
    import torch
    device = next(target.parameters()).device

    def first_repeat(prompt):
        ids = list(prompt)
        for t in range(max_new_tokens):
            with torch.inference_mode():
                token = int(target(input_ids=torch.tensor([ids], device=device)).logits[0, -1].argmax())
            if token in ids[len(prompt):]:
                return t
            ids.append(token)
        return max_new_tokens
    drawn = [rng.integers(0, vocab, int(rng.integers(3, 17))).tolist() for _ in range(candidates)]
    return sorted(drawn, key=first_repeat)[:count]


def setting_processors(setting: dict):
    """The reference.processors.Processors of a setting (its logit_bias keys as ints, as JSON loses them)."""
    from ..reference.processors import Processors
    return Processors(**processor_kwargs(setting))


def processor_kwargs(setting: dict) -> dict:
    """A setting's processor keys (PROCESSOR_KEYS) that it sets, as an engine takes them."""
    out = {key: setting[key] for key in PROCESSOR_KEYS if setting.get(key) is not None}
    if "logit_bias" in out:
        out["logit_bias"] = {int(t): float(b) for t, b in out["logit_bias"].items()}
    return out


def sampled_vectors(target, *, prompts=None, samples: int = 512, requests_per_setting: int = 2,
                    max_new_tokens: int = 8, seed: int = 0, settings=SETTINGS, eos_token_ids=None,
                    processors: bool = False) -> "SampledVectors":
    """Sampled vectors for `target`, in memory. prompts: token lists, one per request of a setting
    (default: random ids, 3 to 16 long); samples: per request, a multiple of 4 (twins, and slot
    pairs of twins); eos_token_ids: the ids a row stops at (default: the model's generation config;
    give more for an engine that also stops at other end tokens it cannot be told to ignore, such as
    llama.cpp's end-of-generation set); processors: the settings of processor_settings instead, and
    by default prompts whose greedy continuation repeats itself early (_repeating_prompts)."""
    from ..fast.models import eos_ids_of
    if samples < 4 or samples % 4:
        raise VectorError(f"samples must be a positive multiple of 4, got {samples}")
    rng = np.random.default_rng(seed)
    identity = model_identity(target)
    if prompts is None and processors:
        prompts = _repeating_prompts(target, rng, requests_per_setting, max_new_tokens, identity["vocab_size"])
    elif prompts is None:
        prompts = [rng.integers(0, identity["vocab_size"], int(rng.integers(3, 17))).tolist()
                   for _ in range(requests_per_setting)]
    prompts = [[int(t) for t in p] for p in prompts]
    eos = [int(t) for t in (eos_ids_of(target) if eos_token_ids is None else eos_token_ids)]
    if any(not 0 <= t < identity["vocab_size"] for t in eos):
        raise VectorError(f"EOS ids must lie in the vocabulary [0, {identity['vocab_size']}), got {eos}")
    if processors:
        settings = processor_settings(target, prompts, eos)
    rows = []
    for s in settings:
        for i in range(0, samples, 2):  # one block of batch_size rows: each request twice
            for r, prompt in enumerate(prompts):
                for sample in (i, i + 1):
                    rows.append(dict(id=f"{s['name']}/{r}/{sample}", setting=s["name"], request=f"{s['name']}/{r}",
                                     sample=sample, token_ids=prompt, max_new_tokens=max_new_tokens,
                                     eos_token_ids=eos, temperature=s["temperature"], top_k=s["top_k"],
                                     top_p=s["top_p"], **{k: s[k] for k in PROCESSOR_KEYS if k in s},
                                     seed=int(seed) * 1_000_003 + len(rows)))
    manifest = dict(format=FORMAT, version=VERSION, **identity, eos_token_ids=eos, settings=list(settings),
                    samples=samples, requests_per_setting=len(prompts), max_new_tokens=max_new_tokens,
                    batch_size=2 * len(prompts), alpha=ALPHA, num_rows=len(rows), seed=seed,
                    processors="logit_bias, min_tokens, repetition_penalty, presence and frequency penalties "
                               "(docs/api.md#processors), then temperature, then top-k (ties kept), then top-p "
                               "(smallest most-likely set whose mass reaches top_p), then min_p, renormalised")
    return SampledVectors(manifest, rows)


def make_sampled_vectors(target, out_dir, *, tokenizer=None, **options) -> dict:
    """Write sampled vectors for `target` (sampled_vectors' options) into out_dir; returns the manifest."""
    vectors = sampled_vectors(target, **options)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "rows.jsonl", "w", encoding="utf-8") as f:
        for row in vectors.rows:
            if tokenizer is not None:
                row = dict(row, text=tokenizer.decode(row["token_ids"]))
            f.write(json.dumps(row) + "\n")
    manifest = dict(vectors.manifest, checksums={"rows.jsonl": file_digest(out / "rows.jsonl")})
    manifest["manifest_sha256"] = manifest_digest(manifest, DECISIVE)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


@dataclass
class SampledVectors:
    manifest: dict
    rows: list

    def settings(self) -> list[dict]:
        return self.manifest["settings"]

    def rows_of(self, setting: str) -> list[dict]:
        return [r for r in self.rows if r["setting"] == setting]

    def subset(self, samples: int | None = None, settings=None) -> "SampledVectors":
        """The rows of the first `samples` samples of every request (a multiple of 4 keeps twins and
        slots), of the named settings only if given: smaller vectors for a slow engine."""
        samples = self.manifest["samples"] if samples is None else samples
        kept = [s for s in self.manifest["settings"] if settings is None or s["name"] in settings]
        names = {s["name"] for s in kept}
        rows = [r for r in self.rows if r["sample"] < samples and r["setting"] in names]
        return SampledVectors(dict(self.manifest, samples=samples, num_rows=len(rows), settings=kept), rows)


def without_settings(vectors: SampledVectors, names: str):
    """(the vectors less the settings that use any of the processor keys `names`, comma-separated;
    the names of the settings left out)."""
    keys = set(filter(None, (names or "").split(",")))
    unknown = keys - set(PROCESSOR_KEYS)
    if unknown:
        raise VectorError(f"--without: unknown setting {sorted(unknown)[0]!r}; expected some of "
                          f"{', '.join(PROCESSOR_KEYS)}")
    left_out = [s["name"] for s in vectors.settings() if set(processor_kwargs(s)) & keys]
    return vectors.subset(settings=[s["name"] for s in vectors.settings() if s["name"] not in left_out]), left_out


def is_sampled(path) -> bool:
    """Whether folder `path` holds sampled vectors (rather than greedy ones)."""
    try:
        return json.loads((Path(path) / "manifest.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def load_sampled_vectors(path, allow_modified: bool = False, warn=None) -> SampledVectors:
    """The sampled vectors in folder `path`, every row checked (VectorError naming the file, row and field)."""
    path = Path(path)
    if not (path / "manifest.json").is_file():
        raise VectorError(f"{path}: no manifest.json (not a vector folder)")
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except ValueError as e:
        raise VectorError(f"{path}/manifest.json: not JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise VectorError(f"{path}/manifest.json: not a specbatch sampled-vectors manifest")
    if not (path / "rows.jsonl").is_file():
        raise VectorError(f"{path}: rows.jsonl is missing")
    check_manifest_digest(manifest, DECISIVE, f"{path}/manifest.json", allow_modified, warn)
    if manifest.get("checksums", {}).get("rows.jsonl") != file_digest(path / "rows.jsonl"):
        problem = f"{path}/rows.jsonl differs from the vectors that were made (its SHA-256 is not the manifest's)"
        if not allow_modified:
            raise VectorError(f"{problem}; make them again, or pass --allow-modified to check against them anyway")
        if warn is not None:
            warn(f"{problem}; checking against them anyway (--allow-modified)")
    rows = _jsonl(path / "rows.jsonl", "rows file")
    names = {s["name"] for s in manifest["settings"]}
    for r in rows:
        where = f"{path}/rows.jsonl: row {r['id']!r}"
        if r.get("setting") not in names:
            raise VectorError(f"{where}: field 'setting' names no setting of the manifest")
        if not _token_list(r.get("token_ids"), nonempty=True) or max(r["token_ids"]) >= manifest["vocab_size"]:
            raise VectorError(f"{where}: field 'token_ids' must be a non-empty list of ids below the vocabulary")
        if not _is_int(r.get("max_new_tokens")) or r["max_new_tokens"] < 1:
            raise VectorError(f"{where}: field 'max_new_tokens' must be a positive integer")
    if len(rows) != manifest.get("num_rows"):
        raise VectorError(f"{path}: rows.jsonl holds {len(rows)} rows, the manifest says {manifest.get('num_rows')}")
    return SampledVectors(manifest, rows)


# ---------------------------------------------------------------- the target's conditionals

def reference_probs(logits, temperature: float, top_k, top_p, slack: float = 0.0, min_p: float = 0.0):
    """Probabilities [..., V] (float64) under the reference semantics, of logits already processed
    (process_logits). slack > 0 widens every boundary (logits within slack * (1 + |k-th|) of the
    k-th kept; under top-p, mass before a token up to top_p + slack, or its logit within
    slack * (1 + |last|) of the last kept token's, which an engine whose logits round differently
    can rank above it; under min_p, likewise around the floor): the set an engine that rounds
    differently may still sample from."""
    import torch
    x = logits.double() / temperature
    if top_k is not None and top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth - slack * (1 + kth.abs()), float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        outside = before >= top_p + slack
        if slack > 0:  # a token whose logit is within the slack of the last kept one may swap places with it
            last = sorted_x.masked_fill(outside, float("inf")).min(dim=-1, keepdim=True).values
            outside = outside & (sorted_x < last - slack * (1 + last.abs()))
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, outside)
        x = x.masked_fill(drop, float("-inf"))
    if min_p:  # probability >= min_p x the largest: logit >= the largest + log(min_p)
        floor = x.max(dim=-1, keepdim=True).values + math.log(min_p)
        x = x.masked_fill(x < floor - slack * (1 + floor.abs()), float("-inf"))
    return x.softmax(dim=-1)


def _processed(flat, setting: dict, prompts, continuations, eos_ids):
    """flat [N, V] (one row per continuation token, in order) after the setting's logit processors,
    each row processed from its own prefix: the reference's process_logits, row by row."""
    import torch

    from ..reference.processors import process_logits
    proc = setting_processors(setting)
    if not proc.changes_logits:
        return flat
    rows, n = flat.double().cpu().numpy(), 0
    out = np.empty_like(rows)
    for prompt, cont in zip(prompts, continuations):
        for t in range(len(cont)):
            out[n] = process_logits(rows[n], prompt, cont[:t], proc, eos_ids)
            n += 1
    return torch.from_numpy(out).to(flat.device)


@dataclass
class Conditionals:
    """The target's conditionals at every token of some sequences (prompt + continuation)."""
    p: list  # per sequence: probability of each continuation token [len]
    raw: list  # per sequence: the target's raw log-probability of each continuation token (no processor) [len]
    before: list  # per sequence: mass of the tokens ranked ahead of it (descending probability) [len]
    outside: list  # (sequence, position, beyond the slack): tokens of probability 0
    cells: dict  # (sequence, position) -> Cochran cells of the node there, for the positions asked


def _continuation_logits(target, prompts, continuations):
    """Per chunk of sequences: (first index, last index + 1, logits [N, V] predicting each
    continuation token in order). Hugging Face models run each distinct prompt once and its
    continuations on a copy of its KV cache (right-padded; a row attends only to its own tokens);
    other models run every whole sequence."""
    import copy

    import torch
    device = next(target.parameters()).device
    vocab = target.get_output_embeddings().weight.shape[0]
    budget = max(1, int(2.5e7 // vocab))  # continuation tokens per chunk: [tokens, V] float64 stays small
    cached = type(target).__module__.startswith("transformers.")
    start = 0
    while start < len(prompts):
        stop, tokens = start, 0
        while stop < len(prompts) and (stop == start or (tokens + len(continuations[stop]) <= budget
                                                         and (not cached or prompts[stop] == prompts[start]))):
            tokens += len(continuations[stop])
            stop += 1
        conts = [list(continuations[i]) for i in range(start, stop)]
        with torch.inference_mode():
            if cached:
                from transformers import DynamicCache

                from ..fast.models import cache_argument
                keyword = cache_argument(target)  # `cache` in current transformers
                prompt = list(prompts[start])
                cache = DynamicCache(config=target.config)
                head = target(input_ids=torch.tensor([prompt], device=device), **{keyword: cache},
                              use_cache=True, logits_to_keep=1).logits[0, -1]
                width = max(1, max(map(len, conts)) - 1)  # the last token of a row predicts nothing asked
                ids = torch.tensor([c[:-1] + [0] * (width - max(len(c) - 1, 0)) for c in conts], device=device)
                real = torch.tensor([len(c) - 1 for c in conts], device=device)
                mask = torch.cat([torch.ones(len(conts), len(prompt), dtype=torch.long, device=device),
                                  (torch.arange(width, device=device)[None, :] < real[:, None]).long()], dim=1)
                rows_cache = copy.deepcopy(cache)
                rows_cache.batch_repeat_interleave(len(conts))
                positions = len(prompt) + torch.arange(width, device=device)[None, :].expand(len(conts), -1)
                body = target(input_ids=ids, attention_mask=mask, **{keyword: rows_cache}, use_cache=True,
                              position_ids=positions).logits
                parts = [torch.cat([head[None], body[j, :len(c) - 1]]) for j, c in enumerate(conts) if c]
            else:
                group = [list(prompts[i]) + conts[i - start] for i in range(start, stop)]
                width = max(map(len, group))
                ids = torch.tensor([g + [0] * (width - len(g)) for g in group], device=device)
                lengths = torch.tensor([len(g) for g in group], device=device)
                mask = torch.arange(width, device=device)[None, :] < lengths[:, None]
                low = min(len(prompts[i]) for i in range(start, stop)) - 1  # logits only where a token is predicted
                logits = target(input_ids=ids, attention_mask=mask.long(),
                                logits_to_keep=torch.arange(low, width, device=device)).logits
                parts = [logits[i - start, len(prompts[i]) - 1 - low:len(prompts[i]) - 1 - low + len(conts[i - start])]
                         for i in range(start, stop) if conts[i - start]]
        yield start, stop, torch.cat(parts) if parts else None
        start = stop


def token_logprobs(model, prompts, continuations) -> list:
    """Each continuation token's raw log-probability under `model` (its log-softmax, no processor),
    one float64 array per sequence: what an engine returns as raw logprobs."""
    import torch
    order = sorted(range(len(prompts)), key=lambda i: tuple(prompts[i]))  # one prompt's sequences together
    out = [np.zeros(0)] * len(prompts)
    for first, last, flat in _continuation_logits(model, [prompts[i] for i in order], [continuations[i] for i in order]):
        if flat is None:
            continue
        conts = [list(continuations[order[k]]) for k in range(first, last)]
        token = torch.tensor([x for c in conts for x in c], device=flat.device)
        values = flat.double().log_softmax(-1).gather(-1, token[:, None])[:, 0].cpu().numpy()
        n = 0
        for k, c in zip(range(first, last), conts):
            out[order[k]], n = values[n:n + len(c)], n + len(c)
    return out


def conditionals(target, setting: dict, prompts, continuations, cell_counts: dict, eos_ids=()) -> Conditionals:
    """The processed distribution at each continuation token of each sequence (prompt +
    continuation; processors see that prefix, min_tokens masks eos_ids), from which the probability
    of that token, the mass ranked ahead of it, and, at the (sequence, position) keys of
    cell_counts, the node's cells for that many samples."""
    import torch
    out = Conditionals([None] * len(prompts), [None] * len(prompts), [None] * len(prompts), [], {})
    order = sorted(range(len(prompts)), key=lambda i: tuple(prompts[i]))  # one prompt's sequences together
    sorted_prompts = [prompts[i] for i in order]
    sorted_conts = [continuations[i] for i in order]
    for first, last, flat in _continuation_logits(target, sorted_prompts, sorted_conts):
        if flat is None:
            for k in range(first, last):
                out.p[order[k]], out.before[order[k]], out.raw[order[k]] = np.zeros(0), np.zeros(0), np.zeros(0)
            continue
        token = torch.tensor([x for k in range(first, last) for x in sorted_conts[k]], device=flat.device)
        raw = flat.double().log_softmax(-1).gather(-1, token[:, None])[:, 0].cpu().numpy()
        flat = _processed(flat, setting, sorted_prompts[first:last], sorted_conts[first:last], eos_ids)
        min_p = setting.get("min_p") or 0.0
        probs = reference_probs(flat, setting["temperature"], setting["top_k"], setting["top_p"], min_p=min_p)
        p_x = probs.gather(-1, token[:, None])[:, 0]
        index = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        ahead = (probs > p_x[:, None]) | ((probs == p_x[:, None]) & (index < token[:, None]))
        before = (probs * ahead).sum(-1).cpu().numpy()
        p_np = p_x.cpu().numpy()
        n = 0
        for k in range(first, last):
            i, cont = order[k], sorted_conts[k]
            out.p[i], out.before[i], out.raw[i] = p_np[n:n + len(cont)], before[n:n + len(cont)], raw[n:n + len(cont)]
            for t in range(len(cont)):
                if p_np[n + t] == 0:
                    wide = reference_probs(flat[n + t:n + t + 1], setting["temperature"], setting["top_k"],
                                           setting["top_p"], SLACK, min_p)[0, cont[t]]
                    out.outside.append((i, t, bool(wide == 0)))
                if (i, t) in cell_counts:
                    out.cells[(i, t)] = _cells(probs[n + t].cpu().numpy(), cell_counts[(i, t)])
            n += len(cont)
    return out


def _cells(probs, count: int):
    """Cochran cells: the most likely tokens, each of expected count >= CELL_MIN, and one rest cell
    (merged into the last token's cell when its own expectation is smaller)."""
    order = np.argsort(-probs, kind="stable")
    tokens = [int(t) for t in order if probs[t] * count >= CELL_MIN]
    if tokens and (1.0 - probs[tokens].sum()) * count < CELL_MIN:
        tokens = tokens[:-1]
    return tokens, [float(probs[t]) for t in tokens]


# ---------------------------------------------------------------- statistics

def chi2_sf(x: float, df: int) -> float:
    """P(chi-square with df degrees of freedom >= x)."""
    import torch
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(max(x, 0.0) / 2, dtype=torch.float64)))


def poisson_binomial_sf(probs, observed: int) -> float:
    """P(sum of independent Bernoulli(probs) >= observed), exactly."""
    if observed <= 0:
        return 1.0
    pmf = np.zeros(len(probs) + 1)
    pmf[0] = 1.0
    for p in probs:
        pmf[1:] = pmf[1:] * (1 - p) + pmf[:-1] * p
        pmf[0] *= 1 - p
    return float(min(1.0, pmf[observed:].sum()))


def binomial_sf(observed: int, n: int, p: float) -> float:
    """P(Binomial(n, p) >= observed), exactly (log-space terms; the upper tail summed directly)."""
    if observed <= 0:
        return 1.0
    if observed > n:
        return 0.0

    def log_pmf(i: int) -> float:
        return (math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p)
                + (n - i) * math.log1p(-p))
    if observed <= n * p:  # at or below the mean: one less the lower tail
        return max(0.0, 1.0 - sum(math.exp(log_pmf(i)) for i in range(observed)))
    return min(1.0, sum(math.exp(log_pmf(i)) for i in range(observed, n + 1)))


def ks_distance(u) -> float:
    """sup_c |F_n(c) - c| of the values u against the uniform distribution."""
    u = np.sort(np.asarray(u, dtype=float))
    n = len(u)
    if not n:
        return 0.0
    i = np.arange(1, n + 1)
    return float(max((i / n - u).max(), (u - (i - 1) / n).max()))


def tv_lower_bound(position: dict) -> float:
    """The mean TV gap at a (setting, position) is at least its KS statistic less the DKW margin."""
    return max(position["ks"] - position["margin"], 0.0)


def dkw_margin(n: int, delta: float) -> float:
    """Dvoretzky-Kiefer-Wolfowitz: sup |F_n - F| <= this with probability >= 1 - delta."""
    return math.sqrt(math.log(2 / delta) / (2 * n)) if n else 1.0


# ---------------------------------------------------------------- checking

@dataclass
class SampledReport:
    alpha: float
    settings: list = field(default_factory=list)  # per setting: name, rows, tokens, nodes, tree/rank X2, df, p
    independence: list = field(default_factory=list)  # twin and slot: pairs, identical, expected, p
    tail: dict = field(default_factory=lambda: dict(tokens=0, observed=0, expected=0.0, p=1.0))  # pooled
    positions: list = field(default_factory=list)  # per (setting, position): tokens, ks, margin
    violations: list = field(default_factory=list)  # (row id, position, token): outside the kept set
    boundary: int = 0  # tokens within the rounding slack of a boundary (left out of the tests)
    errors: list = field(default_factory=list)  # malformed, missing, extra, duplicated rows
    left_out: list = field(default_factory=list)  # settings the engine cannot express (not run, not judged)
    logprob_mode: str | None = None  # "raw" or "processed" where returned logprobs were checked
    logprob_tolerance: float = 0.0
    logprobs_checked: int = 0  # returned logprobs compared with the reference's
    logprob_errors: list = field(default_factory=list)  # (row id, position, token, returned, reference)

    def p_values(self) -> list[tuple[str, float]]:
        named = [(f"{s['name']} tree", s["p_tree"]) for s in self.settings]
        named += [(f"{s['name']} rank", s["p_rank"]) for s in self.settings]
        named += [("tail", self.tail["p"])] if self.tail["tokens"] else []
        return named + [(f"independence {d['kind']}", d["p"]) for d in self.independence]

    @property
    def threshold(self) -> float:
        return self.alpha / max(1, len(self.p_values()))

    @property
    def conformant(self) -> bool:
        return (not self.errors and not self.violations and not self.logprob_errors
                and all(p >= self.threshold for _, p in self.p_values()))

    def p_value(self) -> float:
        """The Bonferroni-adjusted p-value of the whole check (0 with a support violation or a wrong logprob)."""
        if self.violations or self.logprob_errors:
            return 0.0
        return min(1.0, len(self.p_values()) * min((p for _, p in self.p_values()), default=1.0))

    def table(self) -> str:
        lines = [f"{'setting':<16}{'rows':>6}{'tokens':>8}{'nodes':>7}{'tree X2/df':>13}{'p tree':>10}"
                 f"{'rank X2':>9}{'p rank':>10}"]
        for s in self.settings:
            lines.append(f"{s['name']:<16}{s['rows']:>6}{s['tokens']:>8}{s['nodes']:>7}"
                         f"{s['tree_x2']:>8.1f}/{s['tree_df']:<4}{s['p_tree']:>10.2g}{s['rank_x2']:>9.1f}"
                         f"{s['p_rank']:>10.2g}")
        if self.tail["tokens"]:
            lines.append(f"tail: {self.tail['observed']} of {self.tail['tokens']} tokens in the target's least likely "
                         f"{TAIL_MASS:g} (expected {self.tail['expected']:.1f}), p = {self.tail['p']:.2g}")
        for d in self.independence:
            lines.append(f"independence {d['kind']}: {d['identical']} identical of {d['pairs']} pairs "
                         f"(expected {d['expected']:.2f}), p = {d['p']:.2g}")
        lines.append("TV gap by position (a lower bound on the mean total-variation distance there, "
                     f"jointly at {1 - self.alpha:g}):")
        by_setting: dict = {}
        for row in self.positions:
            by_setting.setdefault(row["setting"], []).append(row)
        for name, rows in by_setting.items():
            cells = " ".join(f"{r['position']}:{tv_lower_bound(r):.3f}{'*' if r['ks'] > r['margin'] else ''}"
                             for r in rows)
            lines.append(f"  {name:<16}{cells}")
        if self.left_out:
            lines.append(f"settings the engine cannot express, left out: {', '.join(self.left_out)}")
        if self.logprob_mode:
            lines.append(f"{self.logprob_mode} logprobs: {self.logprobs_checked} checked, "
                         f"{len(self.logprob_errors)} off by more than {self.logprob_tolerance:.3g}")
        lines.append(f"support violations: {len(self.violations)}; tokens at a rounding boundary (left out): "
                     f"{self.boundary}; threshold per p-value {self.threshold:.2g} (alpha {self.alpha:g} over "
                     f"{len(self.p_values())})")
        return "\n".join(lines)

    def lines(self) -> list[str]:
        """One line per problem: errors, support violations, deviating tests and positions."""
        out = list(self.errors)
        for row_id, position, token in self.violations[:20]:
            out.append(f"{row_id}: token {token} at position {position} is outside the kept set of its setting")
        for row_id, position, token, returned, reference in self.logprob_errors[:20]:
            out.append(f"{row_id}: the {self.logprob_mode} logprob of token {token} at position {position} is "
                       f"{returned}, the reference's {reference:.6g}")
        out += [f"{name}: p = {p:.3g} < {self.threshold:.2g}" for name, p in self.p_values() if p < self.threshold]
        out += [f"{r['setting']} position {r['position']}: TV gap >= {tv_lower_bound(r):.3f} "
                f"({r['tokens']} tokens)" for r in self.positions if r["ks"] > r["margin"]]
        return out


def _validated(vectors, outputs, report):
    """id -> continuation for the rows whose output is well formed; problems go to report.errors."""
    rows = {r["id"]: r for r in vectors.rows}
    seen: dict = {}
    for out in outputs:
        ident = out.get("id")
        if ident not in rows:
            report.errors.append(f"output {ident!r}: no such row in the vectors")
            continue
        if ident in seen:
            report.errors.append(f"output {ident!r}: given more than once")
            continue
        tokens, row = out.get("token_ids"), rows[ident]
        if not _token_list(tokens) or any(t >= vectors.manifest["vocab_size"] for t in tokens):
            report.errors.append(f"{ident}: 'token_ids' must be a list of ids below {vectors.manifest['vocab_size']}")
            continue
        eos = set(row["eos_token_ids"])
        stop = next((i for i, t in enumerate(tokens) if t in eos), None)
        if len(tokens) > row["max_new_tokens"]:
            report.errors.append(f"{ident}: {len(tokens)} tokens, past the budget of {row['max_new_tokens']}")
        elif stop is not None and stop < len(tokens) - 1:
            report.errors.append(f"{ident}: continues past the EOS at position {stop}")
        elif stop is None and len(tokens) < row["max_new_tokens"]:
            report.errors.append(f"{ident}: stops after {len(tokens)} tokens with no EOS, before its budget")
        else:
            seen[ident] = list(tokens)
    missing = [i for i in rows if i not in seen and i not in {o.get("id") for o in outputs}]
    if missing:
        report.errors.append(f"{len(missing)} row(s) have no output, e.g. {missing[:3]}")
    return seen


def _node_ids(requests, tokens, lengths, vocab: int):
    """Node id [n, L] of every token: rows share a node at position t when they belong to one
    request and agree on tokens 0..t-1 (ids from the request, then from (parent, token) pairs)."""
    n, width = tokens.shape
    node = np.full((n, width), -1, dtype=np.int64)
    node[:, 0] = requests
    next_id = int(requests.max()) + 1 if n else 0
    for t in range(1, width):
        live = lengths > t
        if not live.any():
            break
        _, inverse = np.unique(node[live, t - 1] * (vocab + 1) + tokens[live, t - 1], return_inverse=True)
        node[live, t] = next_id + inverse
        next_id += int(inverse.max()) + 1
    return node


def _setting_statistics(target, setting, rows, got, rng) -> dict:
    """The tree and rank statistics of one setting's rows, the PIT values by position, each row's
    continuation probability, and the tokens outside the kept set."""
    vocab = int(target.get_output_embeddings().weight.shape[0])
    conts = [got[r["id"]] for r in rows]
    count, width = len(rows), max((len(c) for c in conts), default=0)
    tokens = np.full((count, max(width, 1)), -1, dtype=np.int64)
    for i, c in enumerate(conts):
        tokens[i, :len(c)] = c
    lengths = np.array([len(c) for c in conts], dtype=np.int64)
    valid = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
    names = {}
    requests = np.array([names.setdefault(r["request"], len(names)) for r in rows], dtype=np.int64)
    node = _node_ids(requests, tokens, lengths, vocab) if count else tokens
    sizes = np.bincount(node[valid], minlength=1) if count else np.zeros(1, dtype=np.int64)
    # one forward per distinct sequence; a node's cells from its first row
    unique: dict = {}
    sequence_of = np.array([unique.setdefault((tuple(r["token_ids"]), tuple(c)), len(unique))
                            for r, c in zip(rows, conts)], dtype=np.int64)
    big = np.flatnonzero(sizes >= NODE_MIN)
    wanted, node_at = {}, {}  # a tested node's first (sequence, position) -> its size, its id
    for b in big:
        i, t = np.argwhere((node == b) & valid)[0]
        wanted[(int(sequence_of[i]), int(t))] = int(sizes[b])
        node_at[(int(sequence_of[i]), int(t))] = b
    keys = list(unique)
    eos = rows[0]["eos_token_ids"] if rows else ()
    cond = conditionals(target, setting, [k[0] for k in keys], [k[1] for k in keys], wanted, eos)
    p = np.zeros(tokens.shape)
    before = np.zeros(tokens.shape)
    for i, u in enumerate(sequence_of):
        p[i, :lengths[i]], before[i, :lengths[i]] = cond.p[u], cond.before[u]
    outside, violations, boundary = _outside_kept_set(cond, sequence_of, rows, tokens)
    kept = valid & ~outside
    pit = before + rng.random(tokens.shape) * p
    at_big = np.isin(node, big) & kept
    tree_x2, tree_df = _tree_chi_square(wanted, cond, at_big, node, node_at, tokens)
    rank = pit[kept & ~at_big]
    hist = np.bincount(np.minimum((rank * PIT_BINS).astype(int), PIT_BINS - 1), minlength=PIT_BINS)
    expected = len(rank) / PIT_BINS
    rank_x2 = float(((hist - expected) ** 2 / expected).sum()) if len(rank) else 0.0
    tail = int((pit[kept] > 1 - TAIL_MASS).sum())
    product = np.where(valid, p, 1.0).prod(axis=1)
    with np.errstate(divide="ignore"):
        logprobs = {r["id"]: dict(raw=cond.raw[u], processed=np.log(cond.p[u])) for r, u in zip(rows, sequence_of)}
    return dict(rows=count, tokens=int(kept.sum()), nodes=len(wanted), tree_x2=tree_x2, tree_df=tree_df,
                p_tree=chi2_sf(tree_x2, tree_df), rank_x2=rank_x2, rank_tokens=int(len(rank)),
                p_rank=chi2_sf(rank_x2, PIT_BINS - 1) if len(rank) else 1.0, tail=tail,
                by_position=[pit[:, t][kept[:, t]] for t in range(tokens.shape[1])],
                seq_prob={r["id"]: float(q) for r, q in zip(rows, product)}, logprobs=logprobs,
                violations=violations, boundary=boundary)


def _outside_kept_set(cond, sequence_of, rows, tokens):
    """(cells [N, T] whose token lies outside the setting's kept set, those beyond its boundary slack
    as (row id, position, token) violations, the count within the slack)."""
    outside = np.zeros(tokens.shape, dtype=bool)
    violations, boundary = [], 0
    rows_of_sequence: dict = {}
    for i, u in enumerate(sequence_of):
        rows_of_sequence.setdefault(int(u), []).append(i)
    for u, t, beyond in cond.outside:
        for i in rows_of_sequence[u]:
            outside[i, t] = True
            if beyond:
                violations.append((rows[i]["id"], t, int(tokens[i, t])))
            else:
                boundary += 1
    return outside, violations, boundary


def _tree_chi_square(wanted, cond, at_big, node, node_at, tokens) -> tuple[float, int]:
    """The tree test's chi-square and degrees of freedom: at every prefix node of at least NODE_MIN
    samples, the next tokens seen against the target's conditional (one cell per listed token, one
    for the rest)."""
    tree_x2, tree_df = 0.0, 0
    for (u, t), n in wanted.items():
        cell_tokens, cell_probs = cond.cells[(u, t)]
        here = at_big & (node == node_at[(u, t)])
        seen = tokens[here]
        if not len(seen):  # every token here is outside the kept set (reported as violations)
            continue
        observed = [int((seen == x).sum()) for x in cell_tokens]
        observed.append(len(seen) - sum(observed))
        probs = list(cell_probs) + [max(0.0, 1.0 - sum(cell_probs))]
        cells = [(o, len(seen) * q) for o, q in zip(observed, probs) if q > 0]
        if len(cells) >= 2:
            tree_x2 += sum((o - e) ** 2 / e for o, e in cells)
            tree_df += len(cells) - 1
    return tree_x2, tree_df


def check_samples(vectors, outputs, target, *, batch_size: int | None = None, alpha: float = ALPHA,
                  seed: int = 0, logprobs: str | None = None, tolerance: float | None = None) -> SampledReport:
    """Judge `outputs` (dicts with id and token_ids, one per row) against `target`'s sampling
    distribution. batch_size: what the engine was run with (default: the manifest's); it names the
    slot pairs. seed: the checker's own randomness (the PIT's tie-breaking uniforms). logprobs:
    "raw" or "processed" also checks the log-probability each output gives each of its tokens
    (`check_logprobs`), within `tolerance` (default: the dtype's, conform.logprob_tolerance)."""
    if isinstance(vectors, (str, Path)):
        vectors = load_sampled_vectors(vectors)
    if logprobs not in (None, "raw", "processed"):
        raise VectorError(f"logprobs must be 'raw' or 'processed', got {logprobs!r}")
    report = SampledReport(alpha=alpha)
    got = _validated(vectors, outputs, report)
    batch_size = batch_size or vectors.manifest["batch_size"]
    rng = np.random.default_rng(seed)
    seq_prob: dict = {}  # row id -> probability of its whole continuation
    position_cells = len(vectors.settings()) * vectors.manifest["max_new_tokens"]
    for setting in vectors.settings():
        rows = [r for r in vectors.rows_of(setting["name"]) if r["id"] in got]
        stats = _setting_statistics(target, setting, rows, got, rng)
        report.violations += stats.pop("violations")
        report.boundary += stats.pop("boundary")
        seq_prob.update(stats.pop("seq_prob"))
        expected = stats.pop("logprobs")
        if logprobs:
            check_logprobs(report, outputs, expected, logprobs, tolerance, vectors.manifest["dtype"])
        for t, u in enumerate(stats.pop("by_position")):
            if len(u):
                report.positions.append(dict(setting=setting["name"], position=t, tokens=len(u), ks=ks_distance(u),
                                             margin=dkw_margin(len(u), alpha / position_cells)))
        report.settings.append(dict(name=setting["name"], **stats))
    tokens, observed = sum(s["tokens"] for s in report.settings), sum(s["tail"] for s in report.settings)
    report.tail = dict(tokens=tokens, observed=observed, expected=tokens * TAIL_MASS,
                       p=binomial_sf(observed, tokens, TAIL_MASS))
    report.independence = _independence(vectors, got, seq_prob, batch_size)
    return report


def check_logprobs(report: SampledReport, outputs, expected: dict, mode: str, tolerance: float | None,
                   dtype: str) -> None:
    """Each returned log-probability against the reference's at its own prefix: `raw` is the
    target's log-softmax, `processed` the log-probability of the distribution the token is drawn
    from (processors, temperature, top-k, top-p, min_p). Tokens outside that distribution (at a
    rounding boundary) are skipped; a row without logprobs is an error; a number off by more than
    `tolerance` is reported as (row id, position, token, returned, reference)."""
    from .greedy import _default_ulps, logprob_tolerance, returned_logprobs
    tolerance = logprob_tolerance(dtype, _default_ulps(dtype)) if tolerance is None else tolerance
    report.logprob_tolerance, report.logprob_mode = tolerance, mode
    by_id = {o.get("id"): o for o in outputs}
    for ident, want in expected.items():
        returned = returned_logprobs(by_id[ident])
        if returned is None or len(returned) < len(want[mode]):
            report.errors.append(f"{ident}: no {mode} logprob for every token (give 'logprobs', one number per token)")
            continue
        for t, (a, b) in enumerate(zip(returned, want[mode])):
            report.logprobs_checked += bool(np.isfinite(b))
            if np.isfinite(b) and (a is None or not abs(a - b) <= tolerance):
                report.logprob_errors.append((ident, t, int(by_id[ident]["token_ids"][t]), a, float(b)))


def _independence(vectors, got, seq_prob, batch_size: int) -> list[dict]:
    """Twins (rows 2i and 2i+1 of a setting: one batch) and slot pairs (rows g and g + batch_size of
    the same request, g // batch_size even: one slot of consecutive batches). Under independence, the
    second row's continuation equals the first's with probability p(first's continuation)."""
    out = []
    for kind in ("twin", "slot"):
        probs, identical = [], 0
        for setting in vectors.settings():
            rows = vectors.rows_of(setting["name"])
            if kind == "twin":
                pairs = [(rows[g], rows[g + 1]) for g in range(0, len(rows) - 1, 2)]
            else:
                pairs = [(rows[g], rows[g + batch_size]) for g in range(len(rows) - batch_size)
                         if (g // batch_size) % 2 == 0]
            for a, b in pairs:
                if a["request"] != b["request"] or a["id"] not in got or b["id"] not in got \
                        or not seq_prob.get(a["id"]):  # a token at a rounding boundary: no exact probability
                    continue
                probs.append(seq_prob[a["id"]])
                identical += got[a["id"]] == got[b["id"]]
        out.append(dict(kind=kind, pairs=len(probs), identical=int(identical), expected=float(sum(probs)),
                        p=poisson_binomial_sf(probs, int(identical))))
    return out


def read_sampled_outputs(path) -> list[dict]:
    """An engine's outputs: JSONL lines with id and token_ids."""
    rows = _jsonl(Path(path), "outputs file")
    for row in rows:
        if not isinstance(row.get("token_ids"), list):
            raise VectorError(f"{path}: output {row['id']!r}: 'token_ids' must be a list of integers")
    return rows
