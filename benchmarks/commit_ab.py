"""Two installations of specbatch side by side: an old and a new commit, alternating in one run.

Each repeat runs `PYTHON -m specbatch bench BENCH_ARGS --out-dir OUT/LABEL-REPEAT` with each
interpreter (the order reversed every second repeat, so machine drift touches both alike), then
prints tokens/s per (method, batch size) for each installation, the new/old ratio of every repeat,
and whether both produced the same tokens. OUT/commit_ab.json keeps the figures, the commits, the
commands and the machine.

    python benchmarks/commit_ab.py --old /work/venv_old/bin/python --new /work/venv/bin/python \
        --repeats 2 --out-dir ab_out -- --target smollm2 --draft smollm2-draft+lookup \
        --methods ar,ragged --batch-sizes 1,13
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path


def source_commit(python: str) -> str:
    """The git commit of the checkout that `python`'s specbatch is installed from."""
    folder = subprocess.run([python, "-c", "import os, specbatch; print(os.path.dirname(specbatch.__file__))"],
                            capture_output=True, text=True, check=True, cwd="/").stdout.strip()
    done = subprocess.run(["git", "-C", folder, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", folder, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (done.stdout.strip() or "unknown") + (" (uncommitted changes)" if dirty else "")


def same_tokens(out: Path, repeats: int) -> bool:
    """Whether every run (method, batch size, repeat) produced the same token ids in both installations."""
    def sequences(folder: Path) -> dict:
        rows = [json.loads(line) for line in (folder / "runs.jsonl").read_text().splitlines() if line.strip()]
        return {row["id"]: row.get("sequences") for row in rows if "id" in row}
    return all(sequences(out / f"old-{r}") == sequences(out / f"new-{r}") for r in range(repeats))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="python of the old installation")
    p.add_argument("--new", required=True, help="python of the new installation")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out-dir", required=True)
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then specbatch bench's arguments")
    args = p.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    out = Path(args.out_dir)
    if out.exists() and any(out.iterdir()):
        print(f"{out} is not empty; choose another --out-dir", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    pythons = {"old": args.old, "new": args.new}
    commits = {label: source_commit(python) for label, python in pythons.items()}
    runs: dict = {"old": [], "new": []}
    for repeat in range(args.repeats):
        for label in (("old", "new") if repeat % 2 == 0 else ("new", "old")):
            folder = out.resolve() / f"{label}-{repeat}"
            command = [pythons[label], "-m", "specbatch", "bench", *bench, "--out-dir", str(folder)]
            print(f"[repeat {repeat + 1}/{args.repeats}] {label} ({commits[label]})", file=sys.stderr, flush=True)
            # run outside any checkout: `-m` puts the working folder first on the path
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=out.resolve())
            report = json.loads((folder / "bench.json").read_text())
            runs[label].append(report)
    keys = [(r["method"], r["batch"]) for r in runs["new"][0]["rows"]]
    table = []
    for method, batch in keys:
        speed = {label: [next(r["tokens_per_second"] for r in rep["rows"] if (r["method"], r["batch"]) == (method, batch))
                         for rep in runs[label]] for label in runs}
        exact = {label: [next(r["exact"] for r in rep["rows"] if (r["method"], r["batch"]) == (method, batch))
                         for rep in runs[label]] for label in runs}
        ratios = [n / o for n, o in zip(speed["new"], speed["old"])]
        table.append(dict(method=method, batch=batch, old=speed["old"], new=speed["new"], ratios=ratios,
                          median_ratio=statistics.median(ratios), exact_old=exact["old"], exact_new=exact["new"]))
    lines = [f"old {commits['old']}, new {commits['new']}; {args.repeats} repeats alternating; "
             f"machine: {runs['new'][0]['machine'].get('summary')}", "",
             f"every run's tokens identical between old and new: {same_tokens(out, args.repeats)}", "",
             "| method | batch | old tok/s | new tok/s | new/old per repeat | median | exact old / new |",
             "|---|---|---|---|---|---|---|"]
    for row in table:
        lines.append(f"| {row['method']} | {row['batch']} | {' '.join(f'{v:.1f}' for v in row['old'])} | "
                     f"{' '.join(f'{v:.1f}' for v in row['new'])} | {' '.join(f'{v:.3f}' for v in row['ratios'])} | "
                     f"{row['median_ratio']:.3f} | {', '.join(row['exact_old'])} / {', '.join(row['exact_new'])} |")
    print("\n".join(lines))
    (out / "commit_ab.json").write_text(json.dumps(dict(
        commits=commits, command=shlex.join([sys.executable, *sys.argv]), rows=table,
        machine=runs["new"][0]["machine"]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
