"""The trace format, its writer, and `check_trace`, which validates a trace from any engine.

A trace is JSONL:

1. header: {"trace": "specbatch", "version": 2, "layout": "rectangular" | "ragged",
   "strategy": str, "eos_token_ids": [int], "max_new_tokens": int or [int] (one per request),
   "num_requests": int, "window": int | null, "num_draft_tokens": k, "draft_threshold": float,
   "draft_floor": float (optional; absent: equal to draft_threshold)}
2. one line per round: {"round": r, "rows": [row, ...]} with, per row of the verify forward:
   request (id), prompt_len,
   tokens (the row as laid out: pads included for rectangular, the content for ragged), pad_len
   (0 for ragged), content_len (before the commit), positions (position ids of the row's own verify
   queries, p + 1 of them), mask (one string of '0'/'1' per such query over the KV slots), drafted
   (the row's p proposals), target_argmax (p + 1 ints), draft_limit (p, the row's proposal length),
   cap (optional: at most k), limit (min(k, remaining - 1, cap): the most the row could propose),
   draft_confidence (the draft's confidence at each step run), and the row's proposal rule
   (fast.proposals): either floor (optional, the threshold rule: the header's draft_floor, between
   it and draft_threshold) or worth, calibration and bar (the goodput rule),
   accepted, committed (the tokens committed this round), finished (bool).
3. last line: {"results": [{"request": id, "tokens": [int], "stop_reason": "eos" | "length"}]}

Version 1 traces (no proposal fields; every row drafted its whole limit) are still read.

KV slot s of a row holds content index s - pad_len (rectangular: columns; ragged: pad_len = 0).
The checker derives everything it expects from lengths, never from token values.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .checks import (check_alignment, check_goodput_lengths, check_mask, check_positions, check_proposal_lengths,
                     check_round_commit, check_stop)
from .violations import Violation
from ..errors import SpecbatchError
from ..io import InputError, json_objects, open_for_writing

TRACE_VERSION = 2


class TraceError(SpecbatchError):
    """The trace cannot be read (missing file, bad JSON, missing fields)."""


class TraceWriter:
    """Writes a trace line by line (flushed, so a crash keeps the rounds already done)."""

    def __init__(self, path, *, layout: str, strategy: str, eos_token_ids, max_new_tokens,
                 num_requests: int, window: int | None = None, num_draft_tokens: int = 0,
                 draft_threshold: float = 0.0, draft_floor: float | None = None):
        self.file = open_for_writing(path)
        budgets = ([int(m) for m in max_new_tokens] if isinstance(max_new_tokens, (list, tuple))
                   else int(max_new_tokens))
        self._write({"trace": "specbatch", "version": TRACE_VERSION, "layout": layout, "strategy": strategy,
                     "eos_token_ids": [int(e) for e in eos_token_ids], "max_new_tokens": budgets,
                     "num_requests": int(num_requests), "window": window, "num_draft_tokens": int(num_draft_tokens),
                     "draft_threshold": float(draft_threshold),
                     "draft_floor": float(draft_threshold if draft_floor is None else draft_floor)})

    def _write(self, obj) -> None:
        self.file.write(json.dumps(obj) + "\n")
        self.file.flush()

    def round(self, index: int, rows: list[dict]) -> None:
        self._write({"round": index, "rows": rows})

    def results(self, sequences, stop_reasons) -> None:
        self._write({"results": [{"request": i, "tokens": [int(t) for t in s], "stop_reason": r}
                                 for i, (s, r) in enumerate(zip(sequences, stop_reasons))]})
        self.file.close()


def mask_strings(allowed: np.ndarray) -> list[str]:
    """Encode a bool [Q, S] mask as one '0'/'1' string per query."""
    return ["".join("1" if a else "0" for a in row) for row in np.asarray(allowed)]


def read_trace(path) -> tuple[dict, list[dict], dict | None]:
    path = Path(path)
    try:
        numbered = json_objects(path, "trace")
    except InputError as e:
        raise TraceError(str(e)) from None
    header, rounds, results = None, [], None
    for number, obj in numbered:
        if header is None:
            if obj.get("trace") != "specbatch":
                raise TraceError(f"{path}:{number}: not a specbatch trace (no header line)")
            header = obj
        elif "round" in obj:
            rounds.append(obj)
        elif "results" in obj:
            results = obj
        else:
            raise TraceError(f"{path}:{number}: line is neither a round nor the results")
    if header is None:
        raise TraceError(f"{path}: empty trace")
    validate_schema(path, header, rounds, results)
    return header, rounds, results


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ints(x) -> bool:
    return isinstance(x, list) and all(_is_int(v) for v in x)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# the layout each strategy's verify rows have (the broken variants too: their traces show their violations)
STRATEGY_LAYOUTS = {"eqspec": "rectangular", "exspec": "rectangular", "ragged": "ragged",
                    "bsp-like": "rectangular", "dsd-like": "rectangular"}
HEADER_FIELDS = {  # field: (check, what it must be)
    "version": (lambda x: x in (1, TRACE_VERSION), f"1 or {TRACE_VERSION}"),
    "layout": (lambda x: x in ("rectangular", "ragged"), "'rectangular' or 'ragged'"),
    "strategy": (lambda x: x in STRATEGY_LAYOUTS, f"one of {', '.join(STRATEGY_LAYOUTS)}"),
    "eos_token_ids": (_ints, "a list of integers"),
    "max_new_tokens": (lambda x: _is_int(x) or _ints(x), "an integer or a list of integers"),
    "num_requests": (lambda x: _is_int(x) and x >= 0, "a non-negative integer"),
    "window": (lambda x: x is None or _is_int(x), "an integer or null"),
}
HEADER_FIELDS_V2 = {
    "num_draft_tokens": (lambda x: _is_int(x) and x >= 0, "a non-negative integer"),
    "draft_threshold": (_number, "a number"),
}
ROW_FIELDS = {
    "request": (_is_int, "an integer"), "prompt_len": (_is_int, "an integer"), "tokens": (_ints, "a list of integers"),
    "pad_len": (_is_int, "an integer"), "content_len": (_is_int, "an integer"),
    "positions": (_ints, "a list of integers"),
    "mask": (lambda x: isinstance(x, list) and all(isinstance(m, str) and set(m) <= {"0", "1"} for m in x),
             "a list of '0'/'1' strings"),
    "drafted": (_ints, "a list of integers"), "target_argmax": (_ints, "a list of integers"),
    "draft_limit": (_is_int, "an integer"), "accepted": (_is_int, "an integer"),
    "committed": (_ints, "a list of integers"),
}
ROW_FIELDS_V2 = {
    "limit": (_is_int, "an integer"), "cap": (_is_int, "an integer"),
    "draft_confidence": (lambda x: isinstance(x, list) and all(_number(v) for v in x), "a list of numbers"),
}
RESULT_FIELDS = {"request": (_is_int, "an integer"), "tokens": (_ints, "a list of integers"),
                 "stop_reason": (lambda x: x in ("eos", "length"), "'eos' or 'length'")}


def _require(obj, fields: dict, where: str) -> None:
    for name, (ok, what) in fields.items():
        if name not in obj:
            raise TraceError(f"{where}: field {name!r} is missing")
        if not ok(obj[name]):
            raise TraceError(f"{where}: field {name!r} must be {what}, got {obj[name]!r}"[:300])


def _require_object(obj, fields: dict, where: str) -> None:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: must be an object")
    _require(obj, fields, where)


def validate_schema(path, header: dict, rounds: list, results: dict | None) -> None:
    """The trace's structure (fields present, types right), before any invariant is checked:
    TraceError naming the line's kind and the field."""
    _require(header, HEADER_FIELDS, f"{path}: header")
    if header["layout"] != STRATEGY_LAYOUTS[header["strategy"]]:
        raise TraceError(f"{path}: header: strategy {header['strategy']!r} lays rows out "
                         f"{STRATEGY_LAYOUTS[header['strategy']]}, but the layout says {header['layout']!r}")
    v2 = header["version"] >= 2
    if v2:
        _require(header, HEADER_FIELDS_V2, f"{path}: header")
        if "draft_floor" in header and not _number(header["draft_floor"]):
            raise TraceError(f"{path}: header: field 'draft_floor' must be a number, got {header['draft_floor']!r}")
    if isinstance(header["max_new_tokens"], list) and len(header["max_new_tokens"]) != header["num_requests"]:
        raise TraceError(f"{path}: header: field 'max_new_tokens' has {len(header['max_new_tokens'])} entries for "
                         f"{header['num_requests']} requests")
    for rnd in rounds:
        where = f"{path}: round {rnd.get('round')!r}"
        if not _is_int(rnd.get("round")):
            raise TraceError(f"{where}: field 'round' must be an integer")
        if not isinstance(rnd.get("rows"), list):
            raise TraceError(f"{where}: field 'rows' must be a list of rows")
        for i, row in enumerate(rnd["rows"]):
            _require_object(row, {**ROW_FIELDS, **(ROW_FIELDS_V2 if v2 else {})}, f"{where}, row {i}")
            for name in ("floor", "worth", "calibration", "bar"):
                if name in row and not _number(row[name]):
                    raise TraceError(f"{where}, row {i}: field '{name}' must be a number, got {row[name]!r}")
            if "bar" in row and not all(_number(row.get(name)) for name in ("worth", "calibration")):
                raise TraceError(f"{where}, row {i}: a row with 'bar' (the goodput rule) needs numbers 'worth' and "
                                 "'calibration'")
            if not 0 <= row["request"] < header["num_requests"]:
                raise TraceError(f"{where}, row {i}: field 'request' is {row['request']}, not a request of the "
                                 f"header's {header['num_requests']}")
    if results is not None:
        if not isinstance(results.get("results"), list):
            raise TraceError(f"{path}: results line: field 'results' must be a list")
        for i, r in enumerate(results["results"]):
            _require_object(r, RESULT_FIELDS, f"{path}: results line, entry {i}")


def budget(header: dict, request: int) -> int:
    """max_new_tokens of a request: the header holds one int or one per request."""
    value = header["max_new_tokens"]
    return int(value[request]) if isinstance(value, list) else int(value)


def _check_row(header: dict, row: dict) -> list[Violation]:
    layout = header["layout"]
    tokens, pad, content = row["tokens"], int(row["pad_len"]), int(row["content_len"])
    out = []
    if layout == "rectangular":
        out += check_alignment([pad], [content], len(tokens))
    query_index = np.array([content - 1 + q for q in range(len(row["positions"]))])[None]
    out += check_positions(np.array([row["positions"]]), query_index)
    mask = np.array([[c == "1" for c in m] for m in row["mask"]], dtype=bool)[None]
    slot_index = (np.arange(mask.shape[2]) - pad)[None]
    out += check_mask(mask, query_index, slot_index, header.get("window"))
    remaining = int(row["prompt_len"]) + budget(header, row["request"]) - content
    out += check_round_commit(np.array([row["drafted"]], dtype=np.int64).reshape(1, -1),
                              np.array([row["target_argmax"]]), [row["draft_limit"]], [row["accepted"]],
                              [row["committed"]], [remaining], header["eos_token_ids"])
    if "draft_confidence" in row:  # version 2: the proposal rule (I7), from the row's own fields
        k = int(header.get("num_draft_tokens", 0))
        limit = min(k, remaining - 1, int(row.get("cap", k)))
        if int(row["limit"]) != max(limit, 0):
            out.append(Violation("I7", "the row's limit is not min(k, remaining - 1, cap)", expected=max(limit, 0),
                                 actual=int(row["limit"])))
        if "bar" in row:  # the goodput rule: the row's worth and calibration, the round's bar
            out += check_goodput_lengths([row["draft_limit"]], [row["draft_confidence"]], [max(limit, 0)],
                                         [row["worth"]], [row["calibration"]], float(row["bar"]))
        else:
            threshold = float(header.get("draft_threshold", 0.0))
            run_floor = float(header.get("draft_floor", threshold))
            floor = float(row.get("floor", run_floor))
            if not min(run_floor, threshold) <= floor <= max(run_floor, threshold):
                out.append(Violation("I7", "the row's floor is not between the run's draft_floor and draft_threshold",
                                     expected=f"[{run_floor}, {threshold}]", actual=floor))
            out += check_proposal_lengths([row["draft_limit"]], [row["draft_confidence"]], [max(limit, 0)],
                                          threshold, floor)
        if len(row["drafted"]) != int(row["draft_limit"]) or len(row["positions"]) != int(row["draft_limit"]) + 1:
            out.append(Violation("I7", "the row's drafts or verify queries are not its proposal length",
                                 expected=int(row["draft_limit"]), actual=len(row["drafted"])))
    return [Violation(v.invariant, v.message, row=row["request"], index=v.index, expected=v.expected,
                      actual=v.actual) for v in out]


def check_trace(path) -> list[Violation]:
    """All violations in a trace, in order (round by round; final results last).

    Raises TraceError when the file cannot be read as a trace or its structure is wrong
    (validate_schema: a missing or mistyped field, an unknown layout)."""
    header, rounds, results = read_trace(path)
    eos = header["eos_token_ids"]
    content: dict = {}  # request -> content after its last round
    generated: dict = {}  # request -> tokens committed so far
    finished: set = set()
    out: list[Violation] = []
    try:
        for rnd in rounds:
            for row in rnd["rows"]:
                req = row["request"]
                found = [v.at_round(rnd["round"]) for v in _check_row(header, row)]
                now = row["tokens"][int(row["pad_len"]):][: int(row["content_len"])]
                if req in finished:
                    found.append(Violation("I6", "a finished request is still decoded", row=req, round=rnd["round"]))
                elif req in content and content[req] != now:
                    found.append(Violation("I5", "row content is not the previous content plus the committed tokens",
                                           row=req, round=rnd["round"], expected=content[req], actual=now))
                out += found
                content[req] = now + list(row["committed"])
                generated[req] = generated.get(req, []) + list(row["committed"])
                if row.get("finished"):
                    finished.add(req)
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{path}: malformed round line ({type(e).__name__}: {e})") from None
    if results is None:
        return out + [Violation("S1", "the trace has no results line")]
    returned = [r["request"] for r in results["results"]]
    if returned != list(range(header["num_requests"])):
        out.append(Violation("S2", "results are not all requests in input order",
                             expected=list(range(header["num_requests"])), actual=returned))
    for r in results["results"]:
        req, tokens = r["request"], r["tokens"]
        out += check_stop(tokens, eos, budget(header, req), request=req)
        if req in generated and generated[req] != tokens:
            out.append(Violation("I5", "result differs from the tokens committed in the rounds", row=req,
                                 expected=generated[req], actual=tokens))
    return out
