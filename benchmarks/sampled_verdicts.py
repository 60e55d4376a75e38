"""Verdicts of the sampled checker on real engines: run each engine on sampled vectors, judge it, time both.

    python benchmarks/sampled_verdicts.py --vectors sampled/ --target smollm2 --draft smollm2-draft \
        --engines specbatch-rejection,specbatch-coupled,transformers-sample,transformers-assisted \
        [--samples-for transformers-assisted=64] [--outputs vllm-target-only=vllm.jsonl ...] --out DIR

Engines run in this process (specbatch.conformance.testing adapters, batch size --batch-size;
specbatch-rejection-trees and specbatch-coupled-trees verify token trees of 3 candidates per
position, every row drafting k); --outputs adds
engines run elsewhere (benchmarks/conform_vllm.py) by their outputs file. --samples-for ENGINE=N
runs that engine on the first N samples of each request only (for engines too slow for the full
size; the checker then judges those rows). Writes verdicts.json (per engine: rows, seconds of the
engine and of the checker, p-value, verdict, the report's table, the machine) and verdicts.md.
"""
import argparse
import json
import sys
import time
from pathlib import Path

from transformers import PreTrainedModel

from specbatch.cli.machine import describe_machine
from specbatch.prepare import load
from specbatch.conformance.sampled import check_samples, load_sampled_vectors, read_sampled_outputs
from specbatch.conformance.testing import hf_sampling_engine, run_sampled, specbatch_sampling_engine

TREE_BRANCHES = 3  # the specbatch-*-trees engines' candidates per drafted position


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vectors", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--engines", default="specbatch-rejection,specbatch-coupled,transformers-sample")
    ap.add_argument("--samples-for", action="append", default=[], help="ENGINE=N")
    ap.add_argument("--outputs", action="append", default=[], help="NAME=FILE: outputs of an engine run elsewhere")
    ap.add_argument("--settings-for", action="append", default=[], help="ENGINE=A,B: judge only these settings "
                    "(an engine that failed on the others)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--logprobs", choices=("raw", "processed"), help="also judge the logprobs of every engine whose "
                    "outputs carry them (check_samples(..., logprobs=))")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    vectors = load_sampled_vectors(a.vectors)
    target, draft, _ = load(a.target, a.draft, dtype=vectors.manifest["dtype"])
    smaller = dict(item.split("=") for item in a.samples_for)
    only = {name: names.split(",") for name, names in (item.split("=") for item in a.settings_for)}
    # transformers assists only with a plain Hugging Face model: a reduced-head draft (fast.drafts.reduced_head)
    # lends it the model it wraps (the same weights with the whole head)
    assistant = draft if isinstance(draft, PreTrainedModel) else draft.model
    make = {"specbatch-rejection": lambda: specbatch_sampling_engine(target, draft, "rejection"),
            "specbatch-coupled": lambda: specbatch_sampling_engine(target, draft, "coupled"),
            # token trees (fast.trees): TREE_BRANCHES candidates per drafted position, every row drafting k
            "specbatch-rejection-trees": lambda: specbatch_sampling_engine(target, draft, "rejection", policy="fixed",
                                                                           tree_branches=TREE_BRANCHES),
            "specbatch-coupled-trees": lambda: specbatch_sampling_engine(target, draft, "coupled", policy="fixed",
                                                                         tree_branches=TREE_BRANCHES),
            "transformers-sample": lambda: hf_sampling_engine(target),
            "transformers-assisted": lambda: hf_sampling_engine(target, assistant)}
    results = []
    command = "python benchmarks/sampled_verdicts.py " + " ".join(sys.argv[1:])

    def judge(name, these, outputs, engine_seconds, batch_size):
        start = time.perf_counter()
        numbers = a.logprobs if any("logprobs" in o or "top" in o for o in outputs) else None
        report = check_samples(these, outputs, target, batch_size=batch_size, logprobs=numbers)
        seconds = time.perf_counter() - start
        results.append(dict(engine=name, rows=len(these.rows), samples=these.manifest["samples"],
                            engine_seconds=engine_seconds, check_seconds=round(seconds, 1),
                            p_value=report.p_value(), conformant=report.conformant, violations=len(report.violations),
                            boundary=report.boundary, logprobs=numbers, logprobs_checked=report.logprobs_checked,
                            logprob_errors=len(report.logprob_errors), table=report.table(), lines=report.lines()[:10]))
        print(f"{name}: {'CONFORMANT' if report.conformant else 'NOT CONFORMANT'} p = {report.p_value():.3g}, "
              f"engine {engine_seconds} s, checker {seconds:.1f} s", flush=True)
        print(report.table(), flush=True)
        write(out, command, a.target, a.draft, results)  # after every engine: a later failure loses nothing

    for name in [e for e in a.engines.split(",") if e]:
        these = vectors.subset(int(smaller.get(name, vectors.manifest["samples"])), only.get(name))
        start = time.perf_counter()
        outputs = run_sampled(make[name](), these, batch_size=a.batch_size)
        judge(name, these, outputs, round(time.perf_counter() - start, 1), a.batch_size)
    for item in a.outputs:
        name, _, path = item.partition("=")
        these = vectors.subset(int(smaller.get(name, vectors.manifest["samples"])), only.get(name))
        judge(name, these, read_sampled_outputs(path), None, vectors.manifest["batch_size"])


def write(out: Path, command: str, target: str, draft: str, results: list) -> None:
    """verdicts.json and verdicts.md of the engines judged so far."""
    machine = describe_machine()
    (out / "verdicts.json").write_text(json.dumps(dict(command=command, machine=machine, target=target,
                                                       draft=draft, results=results), indent=1) + "\n")
    lines = ["# Sampled checker: verdicts on real engines", "", f"Command: `{command}`",
             f"Machine: {machine['summary']}", "",
             "| engine | rows (samples per request) | engine s | checker s | p-value | logprobs checked (wrong) | verdict |",
             "|---|---:|---:|---:|---:|---|---|"]
    for r in results:
        numbers = f"{r['logprobs_checked']} {r['logprobs']} ({r['logprob_errors']})" if r.get("logprobs") else "none returned"
        lines.append(f"| {r['engine']} | {r['rows']} ({r['samples']}) | {r['engine_seconds'] or 'elsewhere'} | "
                     f"{r['check_seconds']} | {r['p_value']:.2g} | {numbers} | {'pass' if r['conformant'] else 'REJECTED'} |")
    (out / "verdicts.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
