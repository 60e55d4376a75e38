"""The sampled checker's false-alarm rate and power, measured by simulation at the default size.

    python benchmarks/sampled_power.py --out docs/results/sampled-power [--runs 100] [--null-runs 200]

Engines (specbatch.conformance.sampling_engines) on the toy pair of specbatch.conformance.testing.toy_sampling_pair (a
tiny two-token-context model and a noisy copy as its draft; logits offset to about 24, as in real
models): exact target-only sampling and correct speculative sampling (the null), then each named
bug; the processor bugs (PROCESSOR_BUGS) and their own null runs on the processor vectors
(sampled_vectors(processors=True)). draft-bf16-logits is also run on a pair whose logits sit near 100 (bfloat16's step there is
0.5), to show how its power grows with the rounding it causes. The textbook sampler over token
trees (tree_branches 3: multi-candidate rejection, proofs_notes/trees.md) runs as a null and with
each of TREE_BUGS. Speculative sampling returning raw logprobs (the target's, the null, or the draft's,
LOGPROB_BUGS) is judged with the logprob check too. Each run draws its own vectors
(prompts and row seeds); the checker is specbatch.conformance.sampled.check_samples at alpha 0.001.
Writes power.json (every run's p-value and verdict, and the machine) and power.md (the table).
"""
import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from specbatch.cli.machine import describe_machine
from specbatch.conformance.sampled import ALPHA
from specbatch.conformance.sampling_engines import BUGS, PROCESSOR_BUGS, TREE_BUGS, sampling_engine
from specbatch.conformance.testing import sampled_power, toy_sampling_pair

TREE_BRANCHES = 3  # the tree engines' candidates per drafted position
LOGPROB_BUGS = {"draft-logprobs": "the logprobs returned are the draft's, not the target's (llama.cpp issue 27972, "
                                  "vLLM issue 29216); judged with check_samples(..., logprobs=\"raw\")"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", type=int, default=100, help="runs per broken engine (default 100)")
    ap.add_argument("--null-runs", type=int, default=200, help="runs of exact target-only sampling (default 200)")
    ap.add_argument("--only", help="comma-separated engine names to run (default: all)")
    ap.add_argument("--resume", action="store_true", help="keep the engines already in OUT/power.json, run the rest "
                    "(with --only: run those named, replacing their rows in place)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    target, draft = toy_sampling_pair()
    big_target, big_draft = toy_sampling_pair(logit_offset=100.0)
    cases = [("target-only (null)", target, None, None, a.null_runs, False),
             ("speculative (null)", target, draft, None, a.runs, False),
             ("target-only on processor vectors (null)", target, None, None, a.null_runs, True),
             ("speculative on processor vectors (null)", target, draft, None, a.runs, True)]
    cases += [(bug, target, draft, bug, a.runs, bug in PROCESSOR_BUGS) for bug in BUGS]
    cases.append(("draft-bf16-logits, logits near 100", big_target, big_draft, "draft-bf16-logits", a.runs, False))
    # token trees (3 candidates per position): the correct multi-candidate rejection, then its bugs
    cases.append(("speculative over token trees (null)", target, draft, None, a.runs, False, TREE_BRANCHES))
    cases += [(bug, target, draft, bug, a.runs, False, TREE_BRANCHES) for bug in TREE_BUGS]
    # logprobs (check_samples(..., logprobs="raw")): the engine returns its target's, or its draft's
    scorer = {"speculative returning its target's logprobs (null)": target, "draft-logprobs": draft}
    cases += [(name, target, draft, None, a.runs, False) for name in scorer]
    if a.only:
        cases = [c for c in cases if c[0] in a.only.split(",")]
    machine = describe_machine()
    command = "python benchmarks/sampled_power.py " + shlex.join(sys.argv[1:])
    results = []
    if a.resume and (out / "power.json").is_file():
        earlier = json.loads((out / "power.json").read_text())
        results = earlier["results"]
        command = f"{earlier['command']}; then {command}"
        if not earlier["machine"]["summary"].endswith(machine["summary"]):  # the table names every machine its rows ran on
            machine = dict(machine, summary=f"{earlier['machine']['summary']}; then {machine['summary']}")
        if not a.only:
            cases = [c for c in cases if c[0] not in {r["engine"] for r in results}]
    for name, t, d, bug, runs, processors, *branches in cases:
        start = time.time()
        engine = sampling_engine(t, d, bug=bug, tree_branches=branches[0] if branches else 1)
        reports = sampled_power(engine, t, runs=runs, seed=10_000, processors=processors,
                                logprobs_from=scorer.get(name))
        p = [r.p_value() for r in reports]
        rejected = sum(not r.conformant for r in reports)
        row = dict(engine=name, bug=bug or (name if name in LOGPROB_BUGS else None), runs=runs, rejected=rejected, p_values=p, processors=processors,
                   tree_branches=branches[0] if branches else 1, violations=sum(bool(r.violations) for r in reports),
                   tail_test=True, seconds=round(time.time() - start, 1))
        earlier = [i for i, r in enumerate(results) if r["engine"] == name]
        if earlier:
            results[earlier[0]] = row
        else:
            results.append(row)
        print(f"{name:40s} rejected {rejected}/{runs}  ({time.time() - start:.0f} s)", flush=True)
        write(out, command, machine, results)


def write(out: Path, command: str, machine: dict, results: list) -> None:
    """power.json (every run's p-value) and power.md (the table), rewritten after every engine."""
    (out / "power.json").write_text(json.dumps(dict(command=command, machine=machine, alpha=ALPHA,
                                                    results=results), indent=1) + "\n")
    lines = ["# Sampled checker: false alarms and power at the default size", "",
             f"Command: `{command}`", f"Machine: {machine['summary']}", "",
             "Default vectors (6 settings x 2 requests x 512 samples of 8 tokens); each run draws its own prompts "
             "and seeds. Processor vectors (sampled_vectors(processors=True)): 6 settings with repetition, presence and "
             "frequency penalties, min_p, a logit bias and min_tokens, on prompts whose greedy continuation repeats "
             "itself early. Toy pair: specbatch.conformance.testing.toy_sampling_pair() (logits near 24).", "",
             "| engine | what it does wrong | vectors | runs | rejected | median p-value | largest p-value |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in results:
        p = sorted(r["p_values"])
        vectors = "processors" if r.get("processors") else "default"
        what = {**BUGS, **TREE_BUGS, **LOGPROB_BUGS}.get(r["bug"], "nothing (exact)")
        if r.get("tree_branches", 1) > 1:
            vectors += f", trees of {r['tree_branches']} candidates per position"
        if "logprobs" in r["engine"]:
            vectors += ", raw logprobs checked"
        lines.append(f"| {r['engine']}{'' if r.get('tail_test') else ' †'} | {what} | {vectors} | {r['runs']} | "
                     f"{r['rejected']} | "
                     f"{p[len(p) // 2]:.2g} | {p[-1]:.2g} |")
    if not all(r.get("tail_test") for r in results):
        lines += ["", "† measured before the checker gained its tail test. The tail test only adds a p-value (15 "
                  "Bonferroni terms instead of 14), so a run rejected then is rejected now: each such row's largest "
                  "p-value, times 15/14, is still below 0.001."]
    (out / "power.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
