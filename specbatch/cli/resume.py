"""What a results file was made with, so that `--resume` never mixes runs.

`specbatch generate --out OUT` writes `OUT.settings.json` when it starts afresh: the specbatch
version, the target's and the draft's identity (config and weights hashes), the prompt file's
SHA-256, the chat template flag and every GenerateOptions field that can change an output.
`--resume` compares the run it is asked for with that record and refuses, in one line naming the
first difference, to continue a file made otherwise. What may change across a resume:
RESUMABLE (scheduling only: outputs do not depend on it, S4), the number of processes, and the
progress display. Each kept result is checked too (`check_kept`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from ..io import InputError, loads_strict, replace_atomically, text_lines

RESUMABLE = ("batch_size", "max_wait", "pool_window")  # GenerateOptions fields a resume may change
RECORD_FORMAT = "specbatch-results-settings"


def settings_path(out) -> Path:
    return Path(f"{out}.settings.json")


def _identity(model) -> dict | None:
    """Config and weights hashes of a model (for a draft wrapping a model, of that model)."""
    from ..conformance.greedy import model_identity
    inner = getattr(model, "model", None)
    for candidate in (model, inner):
        if candidate is not None and hasattr(candidate, "config") and hasattr(candidate, "state_dict"):
            try:
                return model_identity(candidate)
            except Exception:  # a draft without an output embedding, etc.: hash its weights alone
                digest = hashlib.sha256()
                for name, p in sorted(candidate.state_dict().items()):
                    digest.update(name.encode() + p.detach().float().cpu().numpy().tobytes())
                return dict(model_class=type(candidate).__name__, weights_sha256=digest.hexdigest())
    return None if model is None else dict(model_class=type(model).__name__)


def run_record(*, target_spec: str, draft_spec: str | None, target, draft, prompts_file, chat_template: bool,
               options, tensor_parallel: int = 1) -> dict:
    """The record of a run: everything that decides its outputs (a tensor-parallel degree above 1
    too: the all-reduces round differently, so float32 outputs may differ at ties)."""
    from .. import __version__
    decisive = {name: value for name, value in dataclasses.asdict(options).items() if name not in RESUMABLE}
    decisive["device"] = str(decisive["device"]).split(":")[0]  # the device type: cuda:0 and cuda:1 are alike
    decisive = json.loads(json.dumps(decisive))  # as the file holds it: lists, string keys
    record = dict(format=RECORD_FORMAT, specbatch=__version__, target=target_spec,
                  target_identity=_identity(target), draft=draft_spec or "none", draft_identity=_identity(draft),
                  prompts_sha256=hashlib.sha256(Path(prompts_file).read_bytes()).hexdigest(),
                  chat_template=bool(chat_template), options=decisive)
    if tensor_parallel > 1:
        record["tensor_parallel"] = tensor_parallel
    return record


def write_record(out, record: dict) -> None:
    replace_atomically(settings_path(out), [json.dumps(record, indent=1) + "\n"])


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    found = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            found.append(f"{prefix}{key} was {a!r}, now {b!r}")
    return found


def check_same_run(out, record: dict) -> None:
    """InputError unless OUT.settings.json records the same run as `record`."""
    path = settings_path(out)
    if not path.exists():
        raise InputError(f"--resume: {out} has no {path.name}, so what made its results is unknown; start afresh "
                         f"without --resume (or with another --out)")
    old = loads_strict("\n".join(text_lines(path, "settings file")), str(path))
    if not isinstance(old, dict) or old.get("format") != RECORD_FORMAT:
        raise InputError(f"--resume: {path} is not a specbatch settings record")
    changed = _differences(old, record)
    if changed:
        raise InputError(f"--resume: {out} was made with other settings ({'; '.join(changed[:3])}"
                         + (f"; {len(changed) - 3} more" if len(changed) > 3 else "")
                         + "); rerun with the same settings, or start afresh without --resume (or with another --out)")


def check_kept(previous: dict, *, vocab: int, eos_ids, budget: int, where, stops: bool = False) -> None:
    """Every kept result plausible for this run: token ids in [0, vocab), num_tokens equal to the
    count, and the stop reason consistent with the budget (length: exactly the budget; eos: ends
    in an EOS id within it; stop, where the run has stop strings: within it). InputError naming
    the result otherwise."""
    eos = set(int(e) for e in eos_ids)
    for ident, rec in previous.items():
        tokens = rec["token_ids"]
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InputError(f"{where}: result {ident!r} has token id {bad}, outside the vocabulary [0, {vocab}); "
                             "remove the line to generate it again")
        reason = rec.get("stop_reason")
        ok = ((reason == "length" and len(tokens) == budget)
              or (reason == "eos" and 0 < len(tokens) <= budget and tokens[-1] in eos)
              or (reason == "stop" and stops and 0 < len(tokens) <= budget))
        if not ok or rec.get("num_tokens", len(tokens)) != len(tokens):
            raise InputError(f"{where}: result {ident!r} ({len(tokens)} tokens, stop_reason {reason!r}) does not fit "
                             f"this run (at most {budget} new tokens, EOS ids {sorted(eos)}); remove the line to "
                             "generate it again")
