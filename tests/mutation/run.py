"""Mutation testing: apply each mutant of tests/mutation/mutants.py to the working tree, run its
tests, restore the file, and report which mutants the suite kills.

    python tests/mutation/run.py                 # all mutants (about 15 minutes on 2 cores)
    python tests/mutation/run.py top-k-one-too-few lookup-across-padding
    python tests/mutation/run.py --json docs/mutation.json

A mutant is killed when its tests fail (pytest exit code 1). Files are restored after every mutant,
also on Ctrl-C or SIGTERM; the script refuses to start on uncommitted changes to the files it mutates.
Not part of the default suite (it runs the suite dozens of times).
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutants import MUTANTS  # noqa: E402


def run_one(mutant, timeout: float) -> dict:
    ident, area, file, old, new, tests = mutant
    path = ROOT / file
    original = path.read_text()
    if original.count(old) != 1:
        return dict(id=ident, area=area, file=file, verdict="stale", detail=f"original text found {original.count(old)}x")
    start = time.time()
    try:
        path.write_text(original.replace(old, new))
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        code = done.returncode
        failed = [line.split(" ")[1] for line in done.stdout.splitlines() if line.startswith("FAILED ")]
    except subprocess.TimeoutExpired:
        code, failed = -1, []
    finally:
        path.write_text(original)
    verdict = {0: "SURVIVED", 1: "killed"}.get(code, "error" if code != -1 else "timeout")
    return dict(id=ident, area=area, file=file, verdict=verdict, seconds=round(time.time() - start, 1),
                killed_by=failed[:1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ids", nargs="*", help="mutant ids (default: all)")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill restores the file too (finally)
    chosen = [m for m in MUTANTS if not args.ids or m[0] in args.ids]
    files = sorted({m[2] for m in chosen})
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *files], cwd=ROOT, capture_output=True, text=True)
    if dirty.stdout.strip():
        print(f"uncommitted changes in files to mutate; commit or stash them first:\n{dirty.stdout}", file=sys.stderr)
        return 2
    every = sorted({t for m in chosen for t in m[5]})
    baseline = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *every], cwd=ROOT,
                              capture_output=True, text=True)
    if baseline.returncode != 0:  # a kill must mean the mutant, not a broken environment or suite
        print(f"the unmutated tests do not pass (exit {baseline.returncode}):\n{baseline.stdout[-2000:]}"
              f"{baseline.stderr[-2000:]}", file=sys.stderr)
        return 2
    rows = []
    for m in chosen:
        row = run_one(m, args.timeout)
        rows.append(row)
        print(f"{row['verdict']:>8}  {row['id']:<36} {row.get('seconds', 0):>6}s  {' '.join(row.get('killed_by', []))}",
              flush=True)
    killed = sum(r["verdict"] == "killed" for r in rows)
    print(f"\nmutants: {len(rows)}, killed: {killed}, score: {100 * killed / max(len(rows), 1):.0f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(mutants=len(rows), killed=killed, rows=rows), indent=1) + "\n")
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
