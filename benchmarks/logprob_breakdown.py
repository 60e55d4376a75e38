"""What the wrong logprobs of a sampled run are: judge an outputs file's samples and logprobs, and
tell the samples' own verdict apart from the logprobs', the returned numbers that are exactly 0.0
from those merely off, and the rows that came back without a number for every token.

    python benchmarks/logprob_breakdown.py --vectors sv-proc-eog --target smollm2 --batch-size 8 \
        --settings t1.0-minp0.1,t0.7-k20-minp0.05,t1.0-bias \
        --outputs llama-f32-target-proc=docs/results/servers/llama-f32-target-proc.sampled.jsonl \
        --outputs llama-f32-spec-proc=docs/results/servers/llama-f32-spec-proc.sampled.jsonl:128 \
        --out docs/results/servers/llama-proc.logprobs.json

An --outputs entry is LABEL=FILE[:SAMPLES] (SAMPLES: the first N samples per request were sent).
"""
import argparse
import json
import shlex
import sys
from pathlib import Path


def breakdown(report) -> dict:
    """The report's verdict split: samples' p-value (Bonferroni over the sample tests only) and the
    logprob errors as exact zeros, other differences, and rows without a number for every token."""
    parts = report.p_values()
    samples_p = min(1.0, min(p for _, p in parts) * len(parts))
    others = [abs(got - want) for _, _, _, got, want in report.logprob_errors if got is not None and got != 0.0]
    return dict(samples_p=samples_p, samples_pass=all(p >= report.threshold for _, p in parts), parts=parts,
                logprobs_checked=report.logprobs_checked, logprobs_off=len(report.logprob_errors),
                exactly_zero=sum(got == 0.0 for _, _, _, got, _ in report.logprob_errors),
                largest_other_difference=max(others, default=0.0),
                tolerance=report.logprob_tolerance,
                rows_without_every_logprob=sum("no raw logprob" in e or "no processed logprob" in e
                                               for e in report.errors))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vectors", required=True)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--settings", help="only these settings (comma-separated names)")
    ap.add_argument("--outputs", action="append", required=True, help="LABEL=FILE[:SAMPLES]")
    ap.add_argument("--logprobs", default="raw", choices=("raw", "processed"))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import specbatch
    from specbatch.cli.machine import describe_machine
    from specbatch.conformance.sampled import check_samples, load_sampled_vectors
    everything = load_sampled_vectors(a.vectors)
    target, _, _ = specbatch.load(a.target, dtype=everything.manifest["dtype"])
    result = dict(command="python benchmarks/logprob_breakdown.py " + shlex.join(sys.argv[1:]),
                  machine=describe_machine())
    for entry in a.outputs:
        label, _, spec = entry.partition("=")
        path, _, samples = spec.partition(":")
        vectors = everything.subset(int(samples) if samples else None, a.settings and a.settings.split(","))
        wanted = {r["id"] for r in vectors.rows}
        rows = [r for r in map(json.loads, Path(path).read_text().splitlines()) if r["id"] in wanted]
        report = check_samples(vectors, rows, target, batch_size=a.batch_size, logprobs=a.logprobs)
        result[label] = dict(rows=len(rows), **breakdown(report))
        print(label, {k: v for k, v in result[label].items() if k != "parts"}, flush=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
