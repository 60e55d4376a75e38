"""Conformance vectors and the output checker: verify any engine's batch speculative decoding.

`make_vectors(target, out_dir)` writes a self-contained workload built to hit the failure classes
of batch speculative decoding (docs/guarantees.md, "Known failure classes"), with the target's greedy answers at batch 1
and, at every answer position, the target's top logits (so the checker needs no model):

    manifest.json    model identity (config and weights hashes, dtype, vocabulary), the EOS ids,
                     the pad id to use (not an EOS id), suggested batch sizes and orders
    requests.jsonl   id, class, token_ids (and text with a tokenizer), max_new_tokens, eos_token_ids
    reference.jsonl  id, token_ids, stop_reason, top: per answer position [[token, logit], ...]

`check_outputs(vectors, outputs)` compares an engine's outputs (id + token_ids, or text only) with
the reference: per request exact, or the first divergence, the reference's top-2 margin there and
the verdict (a floating-point tie when the reference's logit for its own token exceeds the
candidate's by at most `ulps` ulps of the dtype at the top stored logit: fast.equivalence's rule,
which counts at the row's largest |logit|, as far as the stored top logits tell; else algorithmic). Missing, extra and duplicated ids count against conformance.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import SpecbatchError

MIN_CONTEXT = 64  # the longest request of the fixed classes: a 39-token prompt + 16 new tokens, with room
VECTORS_VERSION = 5  # 2: SHA-256 of requests.jsonl and reference.jsonl; 3: a pad id distinct from EOS;
# 4: the manifest's digest of its own fields that decide verdicts (DECISIVE)
# 5: each reference answer token's log-probability (`logprobs`: conform check --logprobs)
DECISIVE = ("format", "version", "model_class", "config_sha256", "weights_sha256", "dtype", "vocab_size",
            "eos_token_ids", "pad_token_id", "num_requests", "classes", "tie_ulps_default", "checksums")
TOP = 8  # logits kept per answer position
CLASSES = ("pad-in-prompt", "eos-in-prompt", "eos-offset", "budget-mid-round", "short-and-long", "duplicate", "churn",
           "wide-margin")


class VectorError(SpecbatchError):
    """Vectors or outputs that cannot be read (a one-line message naming the file)."""


# ---------------------------------------------------------------- making vectors

def model_identity(model) -> dict:
    """What a checker compares before trusting the vectors: config hash, weights hash, dtype."""
    import torch
    config = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
    weights = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        weights.update(name.encode())
        weights.update(p.detach().to(torch.float32).cpu().numpy().tobytes())
    first = next(model.parameters())
    return dict(model_class=type(model).__name__, config_sha256=hashlib.sha256(config.encode()).hexdigest(),
                weights_sha256=weights.hexdigest(), dtype=str(first.dtype).removeprefix("torch."),
                vocab_size=int(model.get_output_embeddings().weight.shape[0]))


def reference_outputs(target, prompts, max_new_tokens, eos_token_ids) -> list[list[int]]:
    """Target-only greedy decoding, one request at a time (batch 1): the oracle."""
    import specbatch
    return [specbatch.generate(target, None, [p], max_new_tokens=m, batch_size=1, eos_token_id=list(eos_token_ids)
                               ).sequences[0] for p, m in zip(prompts, max_new_tokens)]


def _answer_logits(target, prompt, answer):
    """The logits [len(answer), V] (float64) predicting each answer token, from one unpadded forward."""
    import torch

    from ..fast.compute.cache import rect_inputs
    from ..fast.models import ModelRunner, mask_fill_value
    ids = list(prompt) + list(answer[:-1])
    first = next(target.parameters())
    pos, mask = rect_inputs(torch.zeros(1, dtype=torch.long, device=first.device), 0, len(ids), None, first.dtype,
                            mask_fill_value(first.dtype))
    with torch.inference_mode():
        logits = ModelRunner(target)(torch.tensor([ids], device=first.device), pos, mask, None)[0].double()
    return logits[len(prompt) - 1:]


def _top_logits(target, prompt, answer, top: int = TOP, log_softmax: bool = False) -> list[list]:
    """[[token, logit] x top] at every answer position (logprobs with log_softmax)."""
    if not answer:
        return []
    logits = _answer_logits(target, prompt, answer)
    values, tokens = (logits.log_softmax(-1) if log_softmax else logits).topk(top, dim=-1)
    return [[[int(t), float(v)] for t, v in zip(tr, vr)] for tr, vr in zip(tokens.tolist(), values.tolist())]


def _answer_scores(target, prompt, answer) -> tuple[list, list]:
    """(top: [[token, logit] x TOP] at every answer position; logprobs: each answer token's
    log-probability), from one forward."""
    if not answer:
        return [], []
    logits = _answer_logits(target, prompt, answer)
    values, tokens = logits.topk(TOP, dim=-1)
    top = [[[int(t), float(v)] for t, v in zip(tr, vr)] for tr, vr in zip(tokens.tolist(), values.tolist())]
    chosen = logits.log_softmax(-1).gather(-1, logits.new_tensor(answer, dtype=tokens.dtype)[:, None])[:, 0]
    return top, chosen.tolist()


def make_vectors(target, out_dir, *, tokenizer=None, seed: int = 0, max_context: int = 512, progress=None) -> dict:
    """Write the conformance vectors for `target` into out_dir; returns the manifest.
    progress(stage): called as each of the four stages starts (the CLI prints it).

    max_context caps the long prompts (1-token prompts sit next to prompts of about this length, or
    the model's context if smaller), so vectors for a large model stay quick to answer."""
    from ..fast.models import context_limit
    rng = np.random.default_rng(seed)
    identity = model_identity(target)
    say = progress or (lambda stage: None)
    if (context_limit(target) or MIN_CONTEXT) < MIN_CONTEXT:
        raise VectorError(f"the target's context of {context_limit(target)} positions is too short for conformance "
                          f"vectors (their requests need up to {MIN_CONTEXT})")
    requests, eos, pad = _vector_requests(target, rng, identity["vocab_size"], max_context, say)
    say(f"3/4 reference answers: {len(requests)} requests, target-only at batch 1")
    answers = reference_outputs(target, [r["token_ids"] for r in requests], [r["max_new_tokens"] for r in requests],
                                eos)
    say("4/4 top logits along every answer")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    count = len(requests)
    order = list(range(count))
    manifest = dict(format="specbatch-conformance", version=VECTORS_VERSION, **identity, eos_token_ids=eos,
                    pad_token_id=int(pad), num_requests=count, classes=list(CLASSES), seed=seed,
                    tie_ulps_default=_default_ulps(identity["dtype"]),
                    suggested=dict(batch_sizes=[1, 3, 8, count],
                                   orders=dict(input=order, reversed=order[::-1],
                                               shuffled=rng.permutation(count).tolist())))
    with open(out / "requests.jsonl", "w", encoding="utf-8") as f:
        for r in requests:
            row = dict(r, eos_token_ids=eos)
            if tokenizer is not None:
                row["text"] = tokenizer.decode(r["token_ids"])
            f.write(json.dumps(row) + "\n")
    with open(out / "reference.jsonl", "w", encoding="utf-8") as f:
        for r, a in zip(requests, answers):
            stop = "eos" if a and a[-1] in eos else "length"
            top, logprobs = _answer_scores(target, r["token_ids"], a)
            row = dict(id=r["id"], token_ids=a, stop_reason=stop, top=top, logprobs=logprobs)
            if tokenizer is not None:
                row["text"] = tokenizer.decode(a)
            f.write(json.dumps(row) + "\n")
    manifest["checksums"] = {name: file_digest(out / name) for name in ("requests.jsonl", "reference.jsonl")}
    manifest["manifest_sha256"] = manifest_digest(manifest, DECISIVE)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _vector_requests(target, rng, vocab: int, max_context: int, say) -> tuple[list[dict], list[int], int]:
    """(requests of every class, the EOS ids engines stop at, the pad id engines are asked to use),
    drawn from rng; stages 1 and 2 run the target (EOS placements, wide margins)."""
    from ..fast.models import context_limit, eos_ids_of
    model_eos = list(eos_ids_of(target))
    # the pad id the manifest asks engines to use: not an EOS id, so that "pad-in-prompt" (this id inside
    # content) and "eos-in-prompt" (an EOS id inside content, as in engines that pad with EOS) test apart
    pad = next(int(t) for t in rng.permutation(vocab) if int(t) not in model_eos)
    draw = lambda n: rng.integers(0, vocab, int(n)).tolist()  # noqa: E731
    requests: list[dict] = []

    def add(cls, ids, max_new):
        requests.append(dict(id=f"{cls}-{sum(r['class'] == cls for r in requests)}", **{"class": cls},
                             token_ids=[int(t) for t in ids], max_new_tokens=int(max_new)))

    def planted(token, n):
        """n random ids with `token` at three places, as a run where they meet, and at the end."""
        ids = draw(n)
        for at in rng.choice(n, size=3, replace=False):
            ids[at] = token
        ids[-1] = token
        return ids

    for n in (6, 11, 19):
        add("pad-in-prompt", planted(pad, n), 12)
    say("1/4 EOS placements: 8 continuations")
    eos_candidates = [draw(rng.integers(4, 24)) for _ in range(8)]
    continuations = reference_outputs(target, eos_candidates, [12] * 8, [])
    eos = list(model_eos)
    for offset, (prompt, cont) in enumerate(zip(eos_candidates, continuations), 1):  # EOS at offsets 1..8
        token = cont[offset - 1] if offset <= len(cont) else None
        if token is not None and token not in cont[:offset - 1] and token not in eos and token != pad:
            eos.append(int(token))
        add("eos-offset", prompt, 12)
    for n in (6, 11, 19):  # an EOS id inside content: what a mask from `token == pad` breaks when pad == EOS
        add("eos-in-prompt", planted(eos[0] if eos else pad, n), 12)
    for budget in range(1, 10):  # budgets ending at every offset of a round
        add("budget-mid-round", draw(rng.integers(2, 30)), budget)
    limit = min(context_limit(target) or max_context, max_context)
    for n in (1, 1, limit - 40, 1, limit - 24):  # 1-token prompts beside prompts near the context limit
        add("short-and-long", draw(max(n, 1)), 16)
    twice = draw(9)
    for _ in range(3):
        add("duplicate", twice, 10)
    for _ in range(24):  # enough requests, of mixed lengths and budgets, to churn a continuous batcher
        add("churn", draw(rng.integers(1, 40)), int(rng.integers(1, 17)))
    say("2/4 wide-margin requests: 24 candidates")
    candidates = [draw(rng.integers(3, 20)) for _ in range(24)]
    answers = reference_outputs(target, candidates, [10] * 24, eos)
    margins = []
    for p, a in zip(candidates, answers):
        top = _top_logits(target, p, a)
        margins.append(min((t[0][1] - t[1][1] for t in top), default=0.0))
    for i in np.argsort(margins)[::-1][:4]:  # the widest top-2 margins: ties are rare there
        add("wide-margin", candidates[i], 10)
    return requests, eos, pad


def check_tolerance(dtype: str, ulps: float | None, tolerance: float | None, differential: bool = False) -> None:
    """VectorError (one line) unless the tie tolerance asked for is finite, non-negative and within
    its cap. Against the vectors' reference the dtype's: fast.equivalence.TIE_ULPS_CAP ulps (an
    absolute tolerance: that many ulps at a logit of LOGIT_SCALE). Against an engine's own run,
    whose dtype the vectors do not know, the coarsest an engine computes in: 4 bfloat16 ulps at a
    logit of LOGIT_SCALE, 1.0 in logprob (a token e times less likely is no rounding tie)."""
    import torch

    from ..fast.equivalence import TIE_ULPS_CAP
    cap = TIE_ULPS_CAP.get(getattr(torch, dtype, None), 64)
    absolute = logprob_tolerance("bfloat16", 4) if differential else cap * _ulp(LOGIT_SCALE, dtype)
    for name, value, limit in (("--tie-ulps", ulps, cap), ("--tie-tolerance", tolerance, absolute)):
        if value is None:
            continue
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise VectorError(f"{name} must be a finite non-negative number, got {value!r}")
        if value > limit:
            raise VectorError(f"{name} {value:g} is above its cap ({limit:.3g}"
                              + ("" if differential and name == "--tie-tolerance" else f" for {dtype}: 16 times the default")
                              + "); a tolerance that wide would call real differences between tokens ties")


def _default_ulps(dtype: str) -> float:
    import torch

    from ..fast.equivalence import TIE_ULPS
    return TIE_ULPS.get(getattr(torch, dtype, None), 4)


# ---------------------------------------------------------------- reading

def _jsonl(path: Path, what: str) -> list[dict]:
    """The JSON objects of a JSONL file, each with an 'id', read by specbatch.io's strict reader."""
    from ..io import InputError, json_objects
    try:
        numbered = json_objects(path, what)
    except InputError as e:
        raise VectorError(str(e)) from None
    for n, obj in numbered:
        if "id" not in obj:
            raise VectorError(f"{path}:{n}: expected a JSON object with an 'id'")
    return [obj for _, obj in numbered]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_list(value, nonempty: bool = False) -> bool:
    return isinstance(value, list) and (bool(value) or not nonempty) and all(_is_int(t) and t >= 0 for t in value)


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def manifest_digest(manifest: dict, fields) -> str:
    """SHA-256 of the manifest's `fields` (those that decide verdicts), as canonical JSON: read back
    from JSON first, so that integer keys (a logit bias's token ids) sort as the strings they are
    on disk, not as numbers."""
    fields_as_stored = json.loads(json.dumps({k: manifest.get(k) for k in fields}))
    return hashlib.sha256(json.dumps(fields_as_stored, sort_keys=True).encode()).hexdigest()


def check_manifest_digest(manifest: dict, fields, where: str, allow_modified: bool, warn) -> None:
    """Refuse a manifest whose verdict-deciding fields were edited (its digest no longer matches),
    as altered vector files are refused; with allow_modified, warn instead."""
    if manifest.get("manifest_sha256") == manifest_digest(manifest, fields):
        return
    problem = (f"{where}: the fields that decide verdicts ({', '.join(fields)}) differ from those the vectors were "
               "made with" if "manifest_sha256" in manifest else f"{where} has no digest of its fields (vectors made "
               "by an older specbatch)")
    if not allow_modified:
        raise VectorError(f"{problem}; make them again, or pass --allow-modified to check against them anyway")
    if warn is not None:
        warn(f"{problem}; checking against them anyway (--allow-modified)")


def _check_manifest(manifest, where: str) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != "specbatch-conformance":
        raise VectorError(f"{where}: not a specbatch conformance manifest")
    if manifest.get("dtype") not in ("float32", "float64", "bfloat16", "float16"):
        raise VectorError(f"{where}: field 'dtype' must be a floating-point dtype name, got {manifest.get('dtype')!r}")
    for name in ("num_requests", "vocab_size"):
        if not _is_int(manifest.get(name)) or manifest[name] < 1:
            raise VectorError(f"{where}: field {name!r} must be a positive integer, got {manifest.get(name)!r}")
    if not _token_list(manifest.get("eos_token_ids")):
        raise VectorError(f"{where}: field 'eos_token_ids' must be a list of token ids")


def _check_request(r: dict, where: str, vocab: int) -> None:
    if not isinstance(r.get("class"), str):
        raise VectorError(f"{where}: request {r['id']!r}: field 'class' is missing or not a string")
    if not _token_list(r.get("token_ids"), nonempty=True) or max(r["token_ids"]) >= vocab:
        raise VectorError(f"{where}: request {r['id']!r}: field 'token_ids' must be a non-empty list of ids below {vocab}")
    if not _is_int(r.get("max_new_tokens")) or r["max_new_tokens"] < 1:
        raise VectorError(f"{where}: request {r['id']!r}: field 'max_new_tokens' must be a positive integer")
    if not _token_list(r.get("eos_token_ids")):
        raise VectorError(f"{where}: request {r['id']!r}: field 'eos_token_ids' must be a list of token ids")


def _check_reference(r: dict, where: str) -> None:
    if not _token_list(r.get("token_ids")):
        raise VectorError(f"{where}: reference {r['id']!r}: field 'token_ids' must be a list of token ids")
    top = r.get("top")
    ok = isinstance(top, list) and len(top) == len(r["token_ids"]) and all(
        isinstance(t, list) and len(t) >= 2 and all(
            isinstance(pair, list) and len(pair) == 2 and _is_int(pair[0]) and isinstance(pair[1], (int, float))
            and not isinstance(pair[1], bool) and math.isfinite(pair[1]) for pair in t) for t in top)
    if not ok:
        raise VectorError(f"{where}: reference {r['id']!r}: field 'top' must hold, for each answer token, at least two "
                          "[token, finite logit] pairs")


@dataclass
class Vectors:
    manifest: dict
    requests: list
    reference: dict  # id -> reference row

    @property
    def prompts(self) -> list[list[int]]:
        return [r["token_ids"] for r in self.requests]

    @property
    def budgets(self) -> list[int]:
        return [r["max_new_tokens"] for r in self.requests]


def load_vectors(path, allow_modified: bool = False, warn=None) -> Vectors:
    """The vectors in folder `path`, every field checked (VectorError naming the file, request and
    field), and their files checked against the manifest's SHA-256 checksums: altered or shortened
    vectors are refused, or with allow_modified reported through warn(message) and used."""
    from ..io import InputError, loads_strict, text_lines
    if isinstance(path, (Vectors, dict)) or not isinstance(path, (str, Path)):
        raise VectorError(f"vectors must be a folder path or loaded Vectors, got {type(path).__name__}")
    path = Path(path)
    if not path.is_dir():
        raise VectorError(f"{path}: not a folder of conformance vectors" + (" (it is a file)" if path.exists() else ""))
    if not (path / "manifest.json").exists():
        raise VectorError(f"{path}: no manifest.json (not a conformance vector folder)")
    try:
        manifest = loads_strict("\n".join(text_lines(path / "manifest.json", "manifest")), f"{path}/manifest.json")
    except InputError as e:
        raise VectorError(str(e)) from None
    _check_manifest(manifest, f"{path}/manifest.json")
    check_manifest_digest(manifest, DECISIVE, f"{path}/manifest.json", allow_modified, warn)
    checksums = manifest.get("checksums") if isinstance(manifest.get("checksums"), dict) else {}
    for name in ("requests.jsonl", "reference.jsonl"):
        if not (path / name).is_file():
            raise VectorError(f"{path}: {name} is missing")
        if checksums.get(name) != file_digest(path / name):
            problem = (f"{path}/{name} differs from the vectors that were made (its SHA-256 is not the manifest's)"
                       if name in checksums else f"{path}/manifest.json has no checksum of {name}")
            if not allow_modified:
                raise VectorError(f"{problem}; make them again, or pass --allow-modified to check against them anyway")
            if warn is not None:
                warn(f"{problem}; checking against them anyway (--allow-modified)")
    requests = _jsonl(path / "requests.jsonl", "requests file")
    for r in requests:
        _check_request(r, f"{path}/requests.jsonl", manifest["vocab_size"])
    reference = {}
    for r in _jsonl(path / "reference.jsonl", "reference file"):
        _check_reference(r, f"{path}/reference.jsonl")
        reference[r["id"]] = r
    if [r["id"] for r in requests] != list(reference) or len(requests) != manifest["num_requests"]:
        raise VectorError(f"{path}: requests.jsonl, reference.jsonl and the manifest disagree (ids or count)")
    return Vectors(manifest, requests, reference)


def read_outputs(path) -> tuple[list[dict], list[str]]:
    """An engine's outputs: JSONL lines with `id` and `token_ids` (text-only lines are accepted
    with a warning). Returns (rows, warnings)."""
    rows = _jsonl(Path(path), "outputs file")
    warnings = []
    for n, row in enumerate(rows, 1):
        tokens = row.get("token_ids")
        if tokens is None:
            if not isinstance(row.get("text"), str):
                raise VectorError(f"{path}: output {row['id']!r} has neither 'token_ids' nor 'text'")
            warnings.append(f"output {row['id']!r} has text only: compared as text, no tie verdict possible")
        elif not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise VectorError(f"{path}: output {row['id']!r}: 'token_ids' must be a list of integers")
    return rows, warnings


# ---------------------------------------------------------------- checking

@dataclass
class Report:
    requests: list = field(default_factory=list)  # per reference request: dict(id, class, verdict, ...)
    missing: list = field(default_factory=list)
    extra: list = field(default_factory=list)
    duplicated: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    tolerance: float | None = None  # the absolute tie tolerance in effect (None: the ulp rule)

    @property
    def errors(self) -> list:
        return [r for r in self.requests if r["verdict"] == "algorithmic"]

    @property
    def conformant(self) -> bool:
        return not (self.errors or self.missing or self.extra or self.duplicated)

    def table(self) -> str:
        lines = ["| class | requests | exact | floating-point tie | algorithmic | missing |", "|---|---|---|---|---|---|"]
        for cls in sorted({r["class"] for r in self.requests}, key=lambda c: (CLASSES.index(c) if c in CLASSES
                                                                               else len(CLASSES), c)):
            rows = [r for r in self.requests if r["class"] == cls]
            count = lambda v: sum(r["verdict"] == v for r in rows)  # noqa: E731
            lines.append(f"| {cls} | {len(rows)} | {count('exact')} | {count('tie')} | {count('algorithmic')} | "
                         f"{count('missing')} |")
        return "\n".join(lines)

    def lines(self) -> list[str]:
        out = []
        for r in self.requests:
            if r["verdict"] in ("tie", "algorithmic"):
                what = "floating-point tie" if r["verdict"] == "tie" else "ALGORITHMIC DIVERGENCE"
                margin = "" if r.get("margin") is None else f", reference top-2 margin {r['margin']:.3g}"
                out.append(f"{r['id']} ({r['class']}): first divergence at new token {r['index']} ({r['detail']}"
                           f"{margin}) -> {what}")
        out += [f"{i}: missing from the outputs" for i in self.missing]
        out += [f"{i}: not a request of the vectors" for i in self.extra]
        out += [f"{i}: appears more than once in the outputs" for i in self.duplicated]
        return out


def _ulp(value: float, dtype: str) -> float:
    import torch

    from ..fast.equivalence import ulp
    return ulp(value, getattr(torch, dtype, torch.float32))


def judge(reference: dict, got: list[int], dtype: str, ulps: float, threshold: float | None = None) -> dict:
    """Exact, or the first divergence with its verdict, from the stored top scores alone.

    The scores are logits (the vectors' reference) or logprobs (an engine's own reference run): their
    differences at one position are the same. threshold: the absolute tie tolerance; None: `ulps`
    ulps of the dtype at the top score."""
    want = reference["token_ids"]
    j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if j is None and len(got) == len(want):
        return dict(verdict="exact")
    if j is None:  # one is a prefix of the other: a stop (EOS or budget) in the wrong place
        j = min(len(got), len(want))
        detail = "the output stops early" if len(got) < len(want) else "the output continues past the reference's end"
        return dict(verdict="algorithmic", index=j, detail=detail, margin=None)
    top = (reference.get("top") or [])[j] if j < len(reference.get("top") or []) else []
    if len(top) < 2 or want[j] not in dict((t, v) for t, v in top):
        return dict(verdict="algorithmic", index=j, margin=None, detail=f"expected {want[j]}, got {got[j]} (the "
                    "reference has no top scores there to tell a tie)")
    logit = dict((t, v) for t, v in top)
    margin = top[0][1] - top[1][1]
    # the candidate's token outside the stored top: its score is at most the last stored one
    gap = logit[want[j]] - logit.get(got[j], top[-1][1])
    threshold = ulps * _ulp(top[0][1], dtype) if threshold is None else threshold
    tie = got[j] in logit and gap <= threshold
    return dict(verdict="tie" if tie else "algorithmic", index=j, margin=margin, gap=gap, threshold=threshold,
                detail=f"expected {want[j]}, got {got[j]}")


LOGIT_SCALE = 32.0  # an upper bound of language models' top logits (SmolLM2's lie near 15-25)


def logprob_tolerance(dtype: str, ulps: float) -> float:
    """The tie tolerance for an engine's own logprobs, which hide the logits' magnitude: `ulps` ulps
    of the dtype at LOGIT_SCALE (float32, 512 ulps: 2.0e-3; bfloat16, 4 ulps: 1.0)."""
    return ulps * _ulp(LOGIT_SCALE, dtype)


def returned_logprobs(output: dict) -> list | None:
    """The log-probability an output gives each of its tokens (None where it gives none)."""
    if isinstance(output.get("logprobs"), list):
        return [float(v) if isinstance(v, (int, float)) else None for v in output["logprobs"]]
    if isinstance(output.get("top"), list):
        return [dict((int(t), float(v)) for t, v in top).get(int(token)) if isinstance(top, list) else None
                for token, top in zip(output["token_ids"], output["top"])]
    return None


def judge_logprobs(reference: dict, output: dict, mode: str, tolerance: float, warnings: list) -> dict | None:
    """An algorithmic verdict at the first token whose returned logprob is off by more than
    tolerance; None when all agree (positions past the shared tokens, or without a number, are skipped)."""
    want = reference.get("logprobs")
    want = want.get(mode) if isinstance(want, dict) else want  # a plain list: no processors, raw = processed
    got = returned_logprobs(output)
    if want is None:
        warnings.append(f"{reference['id']}: the vectors hold no {mode} logprobs (made before they were kept)")
        return None
    if got is None:
        warnings.append(f"{reference['id']}: the output has no logprobs to check")
        return None
    for j, (a, b, token, expected) in enumerate(zip(got, want, output["token_ids"], reference["token_ids"])):
        if token != expected:
            break
        if a is not None and abs(a - b) > tolerance:
            return dict(verdict="algorithmic", index=j, margin=None, detail=f"the {mode} logprob of token {token} "
                        f"is {a:.6g}, the reference's {b:.6g} (tolerance {tolerance:.3g})")
    return None


def differential_reference(vectors, rows) -> dict:
    """An engine's own reference run (output rows: id, token_ids and, for tie verdicts, top:
    [[token, logprob], ...] per new token) as the reference of `check_outputs`: {id: reference row}.
    VectorError when a request of the vectors is missing or repeated, or a field is malformed."""
    vectors = vectors if isinstance(vectors, Vectors) else load_vectors(vectors)
    reference: dict = {}
    for row in rows:
        ident = str(row["id"])
        if ident in reference:
            raise VectorError(f"the reference outputs hold request {ident!r} twice")
        if not _token_list(row.get("token_ids")):
            raise VectorError(f"the reference outputs: request {ident!r} has no 'token_ids' list of ids")
        top = row.get("top")
        if top is not None and not (isinstance(top, list) and all(
                isinstance(t, list) and all(isinstance(p, list) and len(p) == 2 and _is_int(p[0])
                                            and isinstance(p[1], (int, float)) and math.isfinite(p[1]) for p in t)
                for t in top)):
            raise VectorError(f"the reference outputs: request {ident!r}: 'top' must hold [token, logprob] pairs "
                              "per new token")
        reference[ident] = dict(id=ident, token_ids=list(row["token_ids"]), top=top or [])
    missing = [r["id"] for r in vectors.requests if r["id"] not in reference]
    if missing:
        raise VectorError(f"the reference outputs lack {len(missing)} request(s) of the vectors, e.g. {missing[0]!r}")
    return reference


def check_outputs(vectors, outputs, ulps: float | None = None, reference: dict | None = None,
                  tolerance: float | None = None, logprobs: str | None = None) -> Report:
    """Report on an engine's outputs (rows with id and token_ids or text) against the vectors'
    reference, or against `reference` (differential_reference: the engine's own run), with the
    absolute tie `tolerance` if given (default for a differential reference: logprob_tolerance).
    logprobs ("raw" or "processed", the same here: these vectors have no processors) also checks the
    log-probability an output gives each token it shares with the reference (judge_logprobs), within
    the dtype's logprob tolerance."""
    if logprobs not in (None, "raw", "processed"):
        raise VectorError(f"logprobs must be 'raw' or 'processed', got {logprobs!r}")
    vectors = vectors if isinstance(vectors, Vectors) else load_vectors(vectors)
    dtype = vectors.manifest["dtype"]
    check_tolerance(dtype, ulps, tolerance, differential=reference is not None)
    if ulps is None:
        ulps = vectors.manifest.get("tie_ulps_default", 4)
        try:
            check_tolerance(dtype, ulps, None)
        except VectorError as e:
            raise VectorError(f"the manifest's tie_ulps_default: {e}") from None
    if reference is not None and tolerance is None:
        tolerance = logprob_tolerance(dtype, ulps)
    references = vectors.reference if reference is None else reference
    report = Report(tolerance=tolerance)
    seen: dict = {}
    for row in outputs:
        ident = str(row["id"])
        if ident in seen:
            report.duplicated.append(ident)
        seen[ident] = row
    report.extra = sorted(i for i in seen if i not in vectors.reference)
    for request in vectors.requests:
        ident, ref = request["id"], references[request["id"]]
        row = seen.get(ident)
        base = dict(id=ident, **{"class": request["class"]})
        if row is None:
            report.missing.append(ident)
            report.requests.append(dict(base, verdict="missing"))
        elif row.get("token_ids") is None:
            same = row["text"] == ref.get("text")
            report.requests.append(dict(base, verdict="exact" if same else "algorithmic", index=None,
                                        detail="text differs (text-only output)", margin=None))
        else:
            verdict = judge(ref, list(row["token_ids"]), dtype, ulps, tolerance)
            if logprobs and verdict["verdict"] != "algorithmic":
                verdict = judge_logprobs(vectors.reference[ident], row, logprobs, logprob_tolerance(dtype, ulps),
                                         report.warnings) or verdict
            report.requests.append(dict(base, **verdict))
    return report


ROUND = 5  # tokens one speculative round can commit at the default k = 4: EOS offsets 1..ROUND


def coverage(vectors) -> list[tuple[str, int]]:
    """How often each known failure class occurs in the vectors, read from the vectors themselves
    (requests and reference answers), not from the parameters that made them: [(what, count)]."""
    vectors = vectors if isinstance(vectors, Vectors) else load_vectors(vectors)
    eos = set(vectors.manifest["eos_token_ids"])
    pad = vectors.manifest.get("pad_token_id")
    answers = [vectors.reference[r["id"]]["token_ids"] for r in vectors.requests]
    stops = [len(a) for a in answers if a and a[-1] in eos]
    longest = max(len(p) for p in vectors.prompts)
    rows = [("EOS at the first new token", stops.count(1))]
    rows += [(f"EOS at new token {k} (offset {k} of a round of {ROUND})", stops.count(k)) for k in range(2, ROUND + 1)]
    rows += [("budget of 1 token", sum(m == 1 for m in vectors.budgets)),
             ("pad id inside a prompt", sum(pad in p for p in vectors.prompts)),
             ("EOS id inside a prompt", sum(bool(eos & set(p)) for p in vectors.prompts)),
             ("one-token prompt", sum(len(p) == 1 for p in vectors.prompts)),
             (f"prompt of 80% or more of the longest ({longest})", sum(len(p) >= 0.8 * longest for p in vectors.prompts)),
             ("duplicated prompt", len(vectors.prompts) - len({tuple(p) for p in vectors.prompts})),
             ("mixed budgets (distinct budgets)", len(set(vectors.budgets)))]
    return rows


def coverage_table(vectors) -> str:
    lines = ["| failure class in the vectors | requests |", "|---|---|"]
    return "\n".join(lines + [f"| {what} | {count} |" for what, count in coverage(vectors)])


def check_identity(vectors, model) -> list[str]:
    """Differences between the model and the one the vectors were made with (empty: the same)."""
    manifest = vectors.manifest if hasattr(vectors, "manifest") else load_vectors(vectors).manifest
    return [f"{key}: vectors have {manifest.get(key)!r}, the model has {value!r}"
            for key, value in model_identity(model).items() if manifest.get(key) != value]
