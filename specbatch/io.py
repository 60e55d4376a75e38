"""Prompt files in, result files out.

Prompt files: JSONL with `prompt` (or Spec-Bench style `turns`, whose first turn is used) and an
optional `id` (`question_id` is taken too), or plain text with one prompt per line.

Result files: JSONL, one line per request. Each line is written and flushed as soon as its request
finishes (completion order), so an interrupted run keeps everything it finished; at the end the
file is rewritten in input order (atomically). `--resume` reads the lines already there, skips
those requests and writes the union in input order.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


class InputError(Exception):
    """A problem with an input file; the message names the file and line."""


def read_prompts(path) -> list[tuple[str, str]]:
    """[(id, text)] in file order."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no such prompt file: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a UTF-8 text file") from None
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise InputError(f"{path}: the prompt file is empty")
    if not numbered[0][1].lstrip().startswith("{"):
        return [(str(i), line) for i, (_, line) in enumerate(numbered)]
    prompts = []
    for i, (n, line) in enumerate(numbered):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: malformed JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise InputError(f"{path}:{n}: expected a JSON object with a 'prompt' field")
        if isinstance(obj.get("prompt"), str):
            text = obj["prompt"]
        elif isinstance(obj.get("turns"), list) and obj["turns"] and isinstance(obj["turns"][0], str):
            text = obj["turns"][0]
        else:
            raise InputError(f"{path}:{n}: no 'prompt' string (or 'turns' list) in this line")
        ident = obj.get("id", obj.get("question_id", i))
        prompts.append((str(ident), text))
    ids = [p[0] for p in prompts]
    if len(set(ids)) != len(ids):
        dup = next(x for x in ids if ids.count(x) > 1)
        raise InputError(f"{path}: id {dup!r} appears more than once")
    return prompts


def read_done(path) -> dict:
    """Results already in an output file, by id (a torn last line from a crash is ignored)."""
    path = Path(path)
    done = {}
    if not path.is_file():
        return done
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "id" in obj:
            done[str(obj["id"])] = obj
    return done


class ResultWriter:
    """Appends one flushed line per finished request; `finish` rewrites the file in input order."""

    def __init__(self, path, order: list[str], previous: dict):
        self.path, self.order, self.results = Path(path), order, dict(previous)
        if previous:  # start from a clean file (a crash may have torn the last line)
            self._rewrite()
        self.file = open(self.path, "a" if previous else "w", encoding="utf-8")

    def add(self, record: dict) -> None:
        self.results[record["id"]] = record
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def finish(self) -> None:
        self.file.close()
        self._rewrite()

    def _rewrite(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for ident in self.order:
                if ident in self.results:
                    f.write(json.dumps(self.results[ident]) + "\n")
        os.replace(tmp, self.path)
