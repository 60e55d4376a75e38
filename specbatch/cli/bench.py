"""`specbatch bench`: every method on the same prompts and models in one run, interleaved.

Methods: ar (target-only decoding, batched, same engine), spec1 (speculative at batch 1),
eqspec / exspec / ragged (speculative at each batch size), hf-assisted (transformers' assisted
generation, batch 1 only: it refuses larger batches), and the deliberately broken bsp-like
(rejected drafts kept in the cache) and dsd-like (repad without unpad, bonus from the draft),
whose exact-match collapse reproduces the correctness table of "Batch Speculative Decoding Done
Right". For each (method, batch size) the run
records tokens/s (generated tokens / wall time including prefill), the mean accepted length τ,
the acceptance rate, the time breakdown (draft / verify / align / prefill), the alignment share,
and exact match against target-only greedy decoding at batch 1. Repeats loop outermost and
methods innermost, so machine drift touches every method alike, and every second repeat runs the
methods of a batch size in reverse order (target-only last instead of first), so a machine that
slows down or speeds up during a run favours neither; figures are means over repeats, and beside
each ratio of means the ratios of each repeat's own runs (paired) and their median.
Each finished run is appended to runs.jsonl in --out-dir at once (outputs and stats, fsync'd),
so an interrupted bench keeps its runs and `--resume` runs only the rest; at the end bench.json,
bench.md and two PNG plots are written there. A calibration before and after the runs
(specbatch.cli.calibration) says whether the figures may be quoted: a drift above 10% or a load
average above the cores flags the report NOT QUOTABLE.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from . import calibration
from ..errors import UserError
from .machine import describe_machine
from ..options import GenerateOptions, strategy_names
from ..prepare import encode_prompts, load, read_prompt_file

SHIPPED_PROMPTS = Path(__file__).parents[1] / "data" / "prompts.jsonl"  # bench's default prompt file

BROKEN_METHODS = ("bsp-like", "dsd-like")  # deliberately broken variants: the correctness table
BATCH_ONE = ("spec1", "hf-assisted")


def known_methods() -> tuple:
    """Every method bench runs: each registered strategy (fast.strategies.STRATEGIES) is one."""
    return ("ar",) + BATCH_ONE + strategy_names() + BROKEN_METHODS


def hf_assisted(target, draft, ids, max_new, k, eos_ids):
    """transformers' assisted generation, one prompt at a time (greedy); with the lookup draft,
    transformers' own prompt lookup decoding; with a lookup-first draft, its model alone (transformers
    has no such combination)."""
    from ..fast.drafts.lookup_draft import LookupFirstDraft, PromptLookupDraft
    if isinstance(draft, LookupFirstDraft):
        draft = draft.model
    if isinstance(draft, PromptLookupDraft):
        assist = dict(prompt_lookup_num_tokens=k)
    else:
        assist = dict(assistant_model=draft, num_assistant_tokens=k, num_assistant_tokens_schedule="constant")
    sequences, start = [], time.perf_counter()
    for prompt in ids:
        x = torch.tensor([prompt], device=target.device)
        with torch.inference_mode():
            out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new,
                                  eos_token_id=list(eos_ids) or None, pad_token_id=eos_ids[0] if eos_ids else 0,
                                  **assist)
        new = out[0, len(prompt):].tolist()
        cut = next((j + 1 for j, t in enumerate(new) if t in eos_ids), len(new))
        sequences.append(new[:cut])
    elapsed = time.perf_counter() - start
    generated = sum(len(s) for s in sequences)
    return sequences, dict(tokens_per_second=generated / elapsed, time_total=elapsed, generated_tokens=generated,
                           mean_accepted_length=float("nan"), acceptance_rate=float("nan"), time_draft=0.0,
                           time_verify=0.0, time_align=0.0, time_prefill=0.0, align_share=0.0)


def run_method(method, batch, target, draft, ids, opts: GenerateOptions, eos_ids):
    """One method at one batch size with `opts` (every method shares its forward path and proposal rule)."""
    import specbatch
    if method == "hf-assisted":
        return hf_assisted(target, draft, ids, opts.max_new_tokens, opts.num_draft_tokens, eos_ids)
    # ar: target-only decoding through the ragged engine, the same forward path and options as every method
    strategy = method if method in strategy_names() else ("ragged" if method == "ar" else "eqspec")
    run = dataclasses.replace(opts, strategy=strategy, batch_size=1 if method == "spec1" else batch)
    if method in BROKEN_METHODS:  # they reproduce published mistakes, which drafted k tokens in every row
        from ..api import generate_variant
        fields = {name: getattr(run, name) for name in GenerateOptions.names() if name not in ("strategy",)}
        result = generate_variant(target, draft, ids, variant=method, progress=f"{method} b{batch}",
                                  **{**fields, "policy": "fixed"})
    else:
        result = specbatch.generate(target, None if method == "ar" else draft, ids, run,
                                    progress=f"{method} b{run.batch_size}")
    return result.sequences, result.stats


def paired_ratios(reps: list[dict], ar_reps: list[dict]) -> list[float]:
    """tokens/s of each repeat's run over the same repeat's target-only run at the same batch size."""
    ar_by_repeat = {a["repeat"]: a["tokens_per_second"] for a in ar_reps}
    return [r["tokens_per_second"] / ar_by_repeat[r["repeat"]] for r in reps
            if ar_by_repeat.get(r["repeat"])]


def markdown_table(rows) -> str:
    head = ("| method | batch | tokens/s | vs ar same batch | vs ar per repeat (median) | vs spec1 | τ | acceptance | "
            "draft s | verify s | align s | prefill s | align share | exact match |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        fmt = lambda v, d=2: "-" if v is None or v != v else f"{v:.{d}f}"  # noqa: E731
        ratio = lambda v: "-" if v is None or v != v else f"{v:.2f}x"  # noqa: E731
        paired = "/".join(f"{v:.2f}" for v in r.get("vs_ar_runs") or [])
        paired = f"{paired} ({ratio(r.get('vs_ar_median'))})" if paired else "-"
        lines.append(f"| {r['method']} | {r['batch']} | {fmt(r['tokens_per_second'], 1)} | {ratio(r.get('vs_ar'))} | "
                     f"{paired} | {ratio(r.get('vs_spec1'))} | {fmt(r['mean_accepted_length'])} | {fmt(r['acceptance_rate'])} | "
                     f"{fmt(r['time_draft'])} | {fmt(r['time_verify'])} | {fmt(r['time_align'], 3)} | "
                     f"{fmt(r['time_prefill'])} | {fmt(100 * r['align_share'], 1)}% | {r['exact']} |")
    return "\n".join(lines)


def plot(rows, out_dir: Path) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["batch"], r["tokens_per_second"]) for r in rows if r["method"] == method)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("throughput (CPU)" if not torch.cuda.is_available() else "throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "throughput.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(rows)), 4))
    labels = [f"{r['method']}\nB={r['batch']}" for r in rows]
    bottom = [0.0] * len(rows)
    for part in ("time_prefill", "time_draft", "time_verify", "time_align"):
        values = [r[part] for r in rows]
        ax.bar(labels, values, bottom=bottom, label=part.replace("time_", ""))
        bottom = [b + v for b, v in zip(bottom, values)]
    other = [max(r["time_total"] - b, 0.0) for r, b in zip(rows, bottom)]
    ax.bar(labels, other, bottom=bottom, label="other")
    ax.set_ylabel("seconds")
    ax.set_title("time breakdown")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "breakdown.png", dpi=120)
    plt.close(fig)
    return ["throughput.png", "breakdown.png"]


def prompt_categories(path) -> list[str]:
    """The `category` of each line of a JSONL prompt file (Spec-Bench has one; None where missing)."""
    from ..io import InputError, loads_strict, text_lines
    lines = [line for line in text_lines(Path(path), "prompt file") if line.strip()]
    try:
        objects = [loads_strict(line, str(path)) for line in lines]
    except InputError:
        objects = None
    if objects is None or not all(isinstance(o, dict) for o in objects):
        raise UserError(f"--per-category needs a JSONL prompt file (objects with a 'category'); {path} is not one")
    return [None if o.get("category") is None else str(o["category"]) for o in objects]


def first_per_category(categories: list[str], count: int) -> list[int]:
    """Indices of the first `count` prompts of each category, in file order."""
    seen: dict = {}
    chosen = []
    for i, category in enumerate(categories):
        seen[category] = seen.get(category, 0) + 1
        if seen[category] <= count:
            chosen.append(i)
    return chosen


def select_prompts(path, per_category: int = 0) -> list:
    """The prompt file's (id, text) pairs; per_category > 0: the first that many of each category."""
    prompts = read_prompt_file(path)
    if per_category:
        categories = prompt_categories(path)
        if set(categories) == {None}:
            raise UserError(f"--per-category: no line of {path} has a 'category' field; drop the option or use "
                            "--limit")
        prompts = [prompts[i] for i in first_per_category(["all" if c is None else c for c in categories],
                                                          per_category)]
    return prompts


def read_peer(path, ident_order, UserError) -> tuple[dict, list]:
    """Another engine's results (benchmarks/peer_vllm.py writes them): a header line with `seconds`
    (its generate call's wall time) and optional `label`, then {"id", "token_ids"} per request.
    Returns (header, token ids per prompt in `ident_order`, None where the file has no such id)."""
    from ..io import InputError, loads_strict, text_lines
    try:
        lines = [loads_strict(line, f"{path}:{n}") for n, line in enumerate(text_lines(Path(path), "--compare file"), 1)
                 if line.strip()]
    except InputError as e:
        raise UserError(f"--compare: {e}") from None
    seconds = lines[0].get("seconds") if lines and isinstance(lines[0], dict) else None
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds >= 0:
        raise UserError(f"--compare {path}: the first line must be a header with the engine's 'seconds'")
    by_id = {}
    for n, rec in enumerate(lines[1:], 2):
        tokens = rec.get("token_ids") if isinstance(rec, dict) else None
        if (not isinstance(rec, dict) or not isinstance(rec.get("id"), (str, int)) or isinstance(rec["id"], bool)
                or not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
            raise UserError(f"--compare {path}:{n}: expected {{\"id\": ..., \"token_ids\": [integers]}}")
        by_id[str(rec["id"])] = tokens
    return lines[0], [by_id.get(ident) for ident in ident_order]


class Judge:
    """Each output against the reference (target-only greedy at batch 1): bitwise equal, or its first
    divergence judged a floating-point tie or an error by the ulp rule of the target's dtype
    (fast.equivalence.compare; in bfloat16 two tokens' logits are often equal, and a batch shape
    that rounds one product differently picks the other). Under sampling every output is only
    compared (ties: None). Verdicts are memoised by (request, tokens): repeats mostly repeat them."""

    def __init__(self, target, ids, reference, greedy: bool):
        self.target, self.ids, self.reference, self.greedy = target, ids, reference, greedy
        self.memo: dict = {}

    def __call__(self, sequences) -> dict:
        """{"exact", "ties", "errors"}: counts over the requests (None: not judged, under sampling)."""
        from ..fast.equivalence import compare
        exact, kinds = 0, []
        for i, (got, want) in enumerate(zip(sequences, self.reference)):
            if got is None or got == want:
                exact += got is not None
                continue
            key = (i, tuple(got))
            if self.greedy and key not in self.memo:
                self.memo[key] = compare(self.target, [self.ids[i]], [got], [want])[0]["kind"]
            kinds.append(self.memo.get(key))
        if not self.greedy:
            return dict(exact=exact, ties=None, errors=None)
        return dict(exact=exact, ties=kinds.count("tie"), errors=kinds.count("error"))


def least_agreeing(counts: list[dict]) -> dict:
    """Of several runs' counts (Judge), the one that agrees least: the most errors, then the fewest exact."""
    return max(counts, key=lambda c: (c["errors"] or 0, -c["exact"]))


def agreement(counts: dict, num_prompts: int) -> dict:
    """A row's `exact` cell ("12/13", "4/13 +9 ties", "4/13 +8 ties, 1 ERROR") with its counts."""
    cell = f"{counts['exact']}/{num_prompts}"
    if counts["ties"]:
        cell += f" +{counts['ties']} tie" + ("s" if counts["ties"] > 1 else "")
    if counts["errors"]:
        cell += (", " if counts["ties"] else " ") + f"{counts['errors']} ERROR" + ("S" if counts["errors"] > 1 else "")
    return dict(exact=cell, exact_count=counts["exact"], ties=counts["ties"], errors=counts["errors"])


def peer_rows(peers, judge) -> list[dict]:
    """Table rows of other engines: peers is [(path, header, sequences)] from read_peer; judge: a
    Judge of the reference (a missing request is neither exact nor judged)."""
    rows = []
    for path, header, sequences in peers:
        generated = sum(len(s) for s in sequences if s is not None)
        missing = sum(s is None for s in sequences)
        rows.append(dict(method=str(header.get("label") or header.get("engine") or path), file=str(path),
                         tokens_per_second=generated / header["seconds"] if header["seconds"] else float("nan"),
                         seconds=header["seconds"], generated_tokens=generated, missing=missing,
                         header=header, **agreement(judge(sequences), len(judge.reference))))
    return rows


def peer_table(rows, ours) -> str:
    """Other engines beside the fastest specbatch row of each kind (target-only, speculative); a peer
    whose header says it ran at most `max_num_seqs` requests at a time is compared with specbatch's
    rows at that batch size when the bench measured it."""
    def best(kind, batch=None):
        mine = [r for r in ours if kind(r["method"]) and (batch is None or r["batch"] == batch)]
        return max(mine, key=lambda r: r["tokens_per_second"], default=None)
    is_ar = lambda m: m == "ar"  # noqa: E731
    is_spec = lambda m: m not in ("ar",) + BROKEN_METHODS + ("hf-assisted",)  # noqa: E731
    lines = ["Other engines on the same prompts (their own wall time of one generate call, all requests at once "
             "unless the engine's name says it ran fewer at a time):", "",
             "| engine | tokens/s | specbatch best ar (batch) | ratio | specbatch best speculative (batch) | ratio | "
             "exact match vs specbatch reference |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        limit = r.get("header", {}).get("max_num_seqs")
        at = limit if isinstance(limit, int) and any(o["batch"] == limit for o in ours) else None
        cells = []
        for mine in (best(is_ar, at), best(is_spec, at)):
            if mine is None:
                cells += ["-", "-"]
            else:
                cells += [f"{mine['tokens_per_second']:.1f} ({mine['method']}, {mine['batch']})",
                          f"{mine['tokens_per_second'] / r['tokens_per_second']:.2f}x"]
        note = f" ({r['missing']} ids missing)" if r["missing"] else ""
        name = r["method"] + (f" (at most {limit} at a time)" if isinstance(limit, int) else "")
        lines.append(f"| {name} | {r['tokens_per_second']:.1f} | {' | '.join(cells)} | {r['exact']}{note} |")
    return "\n".join(lines)


def arrival_bench(target, draft, ids, args, opts: GenerateOptions, batch: int, methods) -> list[dict]:
    """Poisson arrivals (rate --arrival-rate, seed 0): request latency (mean and percentiles) and throughput."""
    import numpy as np

    import specbatch
    gaps = np.random.default_rng(0).exponential(1.0 / args.arrival_rate, len(ids))
    arrivals = np.cumsum(gaps) - gaps[0]
    rows = []
    for method in [m for m in methods if m in ("ar",) + strategy_names()]:
        print(f"[arrivals] {method} batch {batch}", file=sys.stderr)
        run = dataclasses.replace(opts, batch_size=batch, strategy="ragged" if method == "ar" else method)
        result = specbatch.generate(target, None if method == "ar" else draft, ids, run, arrivals=list(arrivals),
                                    progress=f"{method} b{batch} arrivals")
        latency = np.array([r["latency"] for r in result.request_stats])
        rows.append(dict(method=method, batch=batch, mean=float(latency.mean()), p50=float(np.percentile(latency, 50)),
                         p90=float(np.percentile(latency, 90)), p99=float(np.percentile(latency, 99)),
                         tokens_per_second=result.stats["tokens_per_second"],
                         running=float(latency.sum() / result.stats["time_total"])))  # mean requests in flight (Little)
    return rows


def arrival_table(rows, rate) -> str:
    lines = [f"Poisson arrivals at {rate} requests/s:", "",
             "| method | batch | mean running | mean latency s | P50 s | P90 s | P99 s | tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['batch']} | {r.get('running', float('nan')):.1f} | {r.get('mean', float('nan')):.2f} | "
              f"{r['p50']:.2f} | {r['p90']:.2f} | {r['p99']:.2f} | {r['tokens_per_second']:.1f} |" for r in rows]
    return "\n".join(lines)


def report_markdown(report: dict) -> str:
    """bench.md from bench.json's content: the command, the machine, the tables."""
    table = markdown_table(report["rows"])
    if report.get("peers"):
        table += "\n\n" + peer_table(report["peers"], report["rows"])
    if report.get("arrivals"):
        table += "\n\n" + arrival_table(report["arrivals"], report.get("arrival_rate"))
    check = report.get("calibration")
    line = ""
    if check:
        line = calibration.describe(check["before"], check["after"], check["verdict"]) + (
            f" ({check['resumed_runs']} runs of an earlier invocation are not covered)" if check["resumed_runs"] else "")
        line += "\n\n"
    return f"Command: `{report['setup']['command']}`\n\nMachine: {report['machine']['summary']}\n\n{line}{table}\n"


def plan_units(methods, batch_sizes, repeats) -> list[dict]:
    """The runs of a bench in the order they run, each with a stable id: the target-only reference at
    batch 1 first when no "ar" run at batch 1 gives it; batch 1 first; repeats outermost; every second
    repeat runs a batch size's methods in reverse (ABBA: drift cancels in pairs)."""
    units = []
    if "ar" not in methods or 1 not in batch_sizes:
        units.append(dict(id="reference", repeat=-1, method="reference", batch=1))
    order = sorted(batch_sizes, key=lambda b: b != 1)  # batch 1 first: its "ar" run is the reference
    for repeat in range(repeats):
        for batch in order:
            ordered = sorted(methods, key=lambda m: m != "ar")
            for method in ordered if repeat % 2 == 0 else ordered[::-1]:
                if method in BATCH_ONE and batch != order[0]:
                    continue
                b = 1 if method in BATCH_ONE else batch
                if method == "eqspec" and b == 1 and "spec1" in methods:
                    continue  # spec1 is eqspec at batch 1: the same computation
                units.append(dict(id=f"r{repeat}-{method}-b{b}", repeat=repeat, method=method, batch=b))
    return units


def finite_or_none(stats: dict) -> dict:
    """Stats as strict JSON holds them: NaN (a figure a method has not) as None."""
    return {k: None if isinstance(v, float) and v != v else v for k, v in stats.items()}


def check_out_dir(out_dir: Path, resume: bool, overwrite: bool) -> None:
    """Nothing replaced unless asked: a folder holding a bench's files needs --resume or --overwrite."""
    from ..io import InputError, check_not_replacing
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out-dir {out_dir} is not a folder")
    try:
        holds = check_not_replacing(out_dir / "runs.jsonl", resume, overwrite, "--out-dir:")
        if not holds and (out_dir / "bench.json").exists() and not overwrite:
            raise InputError(f"--out-dir {out_dir} already holds a bench (bench.json); pass --overwrite to replace it, "
                             "or choose another --out-dir")
    except InputError as e:
        raise UserError(str(e)) from None


def open_journal(path: Path, units, args, opts, target, draft, prompt_file):
    """The journal of finished runs (one fsync'd line each, with its outputs and stats), checked
    against this bench's settings on --resume, started afresh otherwise."""
    from ..io import InputError, ResultWriter, read_done
    from .resume import check_same_run, run_record, write_record
    record = run_record(target_spec=args.target, draft_spec=args.draft, target=target, draft=draft,
                        prompts_file=prompt_file, chat_template=args.chat_template, options=opts)
    record.update(kind="bench", methods=[u["id"] for u in units], per_category=args.per_category, limit=args.limit)
    previous = {}
    try:
        if args.resume and path.exists():
            check_same_run(path, record)
            previous = read_done(path, known_ids=[u["id"] for u in units], field="sequences")
        write_record(path, record)
    except InputError as e:
        raise UserError(str(e)) from None
    return ResultWriter(path, [u["id"] for u in units], previous)


def prepare_kernels(target, draft, opts: GenerateOptions) -> None:
    """Decide the kernel and padding of every row count a decoding step may bring to the linear
    layers (fast.compute.row_plan), so that nothing is measured while a benchmark times its runs.
    Decided once per machine and kept in the specbatch cache folder. The native block loop's
    extension is built (or loaded) here too, so that its first compile is not timed either."""
    import torch

    from ..fast.compute import row_plan
    from ..fast.compute.kernels import prepare_row_plans
    from ..fast.models import ModelRunner
    if opts.native:
        from ..fast.compute import native
        native.extension()
    if not opts.prepack:
        return
    models = [m for m in (target, draft) if isinstance(m, torch.nn.Module)]
    leans = [ModelRunner(m, lean=opts.lean and not opts.compile).lean for m in models]
    leans = [lean for lean in leans if lean is not None]
    made = prepare_row_plans(*models, *leans, up_to=row_plan.MAX_ROWS,
                             skip=[m for lean in leans for m in lean.replaced])  # as generate's forwards run them
    if made:
        print(f"measured which kernel and row count each linear layer runs fastest at ({made} decisions, kept for "
              "this machine)", file=sys.stderr)


def run_bench(args, opts: GenerateOptions) -> int:
    """`specbatch bench`: args holds the bench's own flags (methods, batch sizes, repeats, files), opts
    everything about decoding (the defaults in force for "bench" under the flags given)."""
    from ..fast.models import eos_ids_of
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in known_methods()]
    if unknown:
        raise UserError(f"unknown method {unknown[0]!r}; expected some of {', '.join(known_methods())}")
    prompt_file = args.prompts or SHIPPED_PROMPTS
    prompts = select_prompts(prompt_file, args.per_category)[:args.limit]
    peer_data = [(path, *read_peer(path, [ident for ident, _ in prompts], UserError)) for path in args.compare or []]
    out_dir = Path(args.out_dir)
    journal_path = out_dir / "runs.jsonl"
    check_out_dir(out_dir, args.resume, args.overwrite)
    target, draft, tokenizer = load(args.target, args.draft, dtype=opts.dtype, device=opts.device)
    if draft is None and any(m != "ar" for m in methods):
        raise UserError("speculative methods need --draft")
    ids = encode_prompts([t for _, t in prompts], tokenizer, args.chat_template)
    eos_ids = eos_ids_of(target)
    out_dir.mkdir(parents=True, exist_ok=True)
    units = plan_units(methods, args.batch_sizes, args.repeats)
    journal = open_journal(journal_path, units, args, opts, target, draft, prompt_file)
    args.kept = lambda: (f"{len(journal.results)} of {len(units)} runs are in {journal_path}; --resume runs the rest "
                         "(the same flags with --resume)")
    journal_kept = list(journal.results)  # runs of an earlier invocation: this one's calibration does not cover them
    if journal.results:
        print(f"resuming: {len(journal.results)} of {len(units)} runs already in {journal_path}", file=sys.stderr)
    prepare_kernels(target, draft, opts)
    before = calibration.calibrate()
    try:
        runs, reference = _run_units(units, journal, target, draft, ids, opts, eos_ids, args.repeats)
    finally:
        journal.finish()
    after = calibration.calibrate()
    judge = Judge(target, ids, reference, greedy=not opts.temperature)  # after the timed runs: costs forwards
    judge_runs(runs, judge)
    rows = summary_rows(runs, len(ids))
    machine = describe_machine(opts.device)
    setup = dict(target=args.target, draft=args.draft, prompts=str(prompt_file), num_prompts=len(ids),
                 per_category=args.per_category, limit=args.limit, chat_template=args.chat_template,
                 batch_sizes=args.batch_sizes, methods=methods, repeats=args.repeats,
                 options=dataclasses.asdict(opts), command=getattr(args, "command_line", "specbatch bench"))
    latency_rows = (arrival_bench(target, draft, ids, args, opts, max(args.batch_sizes), methods)
                    if args.arrival_rate else [])
    report = dict(machine=machine, setup=setup, rows=rows, arrivals=latency_rows, arrival_rate=args.arrival_rate,
                  peers=peer_rows(peer_data, judge), calibration=dict(
                      before=before, after=after, verdict=calibration.verdict(before, after),
                      resumed_runs=len(journal_kept)))
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1))
    (out_dir / "bench.md").write_text(report_markdown(report))
    plots = plot(rows, out_dir)
    print(report_markdown(report))
    print(f"wrote {out_dir / 'bench.json'}, {out_dir / 'bench.md'}" + "".join(f", {out_dir / p}" for p in plots),
          file=sys.stderr)
    return 0


def _run_units(units, journal, target, draft, ids, opts: GenerateOptions, eos_ids, repeats: int):
    """Run every unit the journal does not hold yet (each kept in the journal at once); returns
    ({(method, batch): [stats of each repeat, with its `sequences`]}, the reference: target-only greedy
    outputs at batch 1)."""
    import specbatch
    runs: dict = {}
    reference = None  # target-only greedy at batch 1: the first "ar" run at batch 1, else its own run
    for unit in units:
        repeat, method, b = unit["repeat"], unit["method"], unit["batch"]
        if unit["id"] not in journal.results:
            print(f"[repeat {repeat + 1}/{repeats}] {method} batch {b}" if repeat >= 0 else
                  f"reference: target-only greedy at batch 1 on {len(ids)} prompts", file=sys.stderr)
            if method == "reference":
                sequences = specbatch.generate(target, None, ids, dataclasses.replace(
                    opts, batch_size=1, strategy="ragged"), progress="reference (target-only b1)").sequences
                stats = {}
            else:
                sequences, stats = run_method(method, b, target, draft, ids, opts, eos_ids)
            journal.add(dict(id=unit["id"], sequences=sequences, stats=finite_or_none(stats)))
        done = journal.results[unit["id"]]
        if reference is None:
            reference = done["sequences"]
        if method != "reference":
            stats = {k: float("nan") if v is None else v for k, v in done["stats"].items()}
            runs.setdefault((method, b), []).append(dict(stats, sequences=done["sequences"], repeat=repeat))
    return runs, reference


def judge_runs(runs: dict, judge: Judge) -> None:
    """Each run's outputs (taken out of it) become its counts against the reference: exact, ties, errors."""
    for reps in runs.values():
        for run in reps:
            run.update(judge(run.pop("sequences")))


def summary_rows(runs: dict, num_prompts: int) -> list[dict]:
    """One row per (method, batch): the repeats' means, the worst repeat's agreement with the reference
    (the most errors, then the fewest exact), and the ratios over ar (each
    repeat paired with ar's same repeat) and over spec1."""
    rows = []
    for (method, batch), reps in runs.items():
        row = {key: sum(r[key] for r in reps) / len(reps) for key in (
            "tokens_per_second", "mean_accepted_length", "acceptance_rate", "time_draft", "time_verify",
            "time_align", "time_prefill", "time_total", "align_share")}
        row.update(method=method, batch=batch, **agreement(least_agreeing(reps), num_prompts),
                   tokens_per_second_runs=[r["tokens_per_second"] for r in reps])
        rows.append(row)
    by = {(r["method"], r["batch"]): r for r in rows}
    for r in rows:
        ar = by.get(("ar", r["batch"]))
        spec1 = by.get(("spec1", 1))
        r["vs_ar"] = r["tokens_per_second"] / ar["tokens_per_second"] if ar else None
        r["vs_ar_runs"] = paired_ratios(runs[(r["method"], r["batch"])], runs.get(("ar", r["batch"]), []))
        r["vs_ar_median"] = statistics.median(r["vs_ar_runs"]) if r["vs_ar_runs"] else None
        r["vs_spec1"] = r["tokens_per_second"] / spec1["tokens_per_second"] if spec1 else None
    rows.sort(key=lambda r: (r["batch"], known_methods().index(r["method"])))
    return rows
