"""The sampled checker's sensitivity: the smallest total-variation deviation it detects with
probability 0.99, at one position and at every position, measured by simulation.

    python benchmarks/sampled_sensitivity.py --out docs/results/sampled-sensitivity [--sizes 512,2048]
    python benchmarks/sampled_sensitivity.py --out ... --sizes 2048 --places 'first position,every position' --screen 6 \
        --runs 30 --resume  # add a size

An engine of target-only sampling on the toy pair (specbatch.conformance.testing.toy_sampling_pair) with a
planted deviation (specbatch.conformance.sampling_engines.planted_engine): at the planted positions, mass
min(tv, P(top)) moves from the most likely token to the runner-up, so the deviation's
total-variation distance is known token by token. Three places: the first new token, the last
(the 8th), and every position. Per size (samples per request) and place, a bisection over LEVELS
screens a level with --screen runs; the lowest level rejected in every screened run is confirmed
with --runs runs, moving up a level until at least 99% of them are rejected. Each run draws its
own vectors (prompts and row seeds); the checker is specbatch.conformance.sampled.check_samples at alpha 0.001.
Writes sensitivity.json (every level tried) and sensitivity.md (the table).
"""
import argparse
import json
import sys
import time
from pathlib import Path

from specbatch.cli.machine import describe_machine
from specbatch.conformance.sampled import ALPHA
from specbatch.conformance.sampling_engines import planted_engine
from specbatch.conformance.testing import sampled_power, toy_sampling_pair

LEVELS = (0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)
PLACES = {"first position": {0}, "last position": {7}, "every position": None}


def trial(target, level: float, positions, runs: int, samples: int, seed: int) -> dict:
    engine = planted_engine(target, level, positions)
    start = time.time()
    reports = sampled_power(engine, target, runs=runs, seed=seed, samples=samples)
    return dict(level=level, runs=runs, rejected=sum(not r.conformant for r in reports),
                mean_tv=sum(engine.planted) / max(len(engine.planted), 1), seconds=round(time.time() - start, 1))


def smallest_detected(target, positions, samples: int, screen: int, runs: int, log) -> dict:
    """Bisection with screens of `screen` runs, then confirmation with `runs` runs (>= 99% rejected)."""
    tried = []
    low, high = -1, len(LEVELS) - 1  # LEVELS[high] is assumed rejected in every screened run
    while high - low > 1:
        mid = (low + high) // 2
        t = trial(target, LEVELS[mid], positions, screen, samples, seed=30_000 + 1_000 * mid)
        tried.append(t)
        log(t)
        if t["rejected"] == screen:
            high = mid
        else:
            low = mid
    for index in range(high, len(LEVELS)):
        t = trial(target, LEVELS[index], positions, runs, samples, seed=90_000 + 1_000 * index)
        tried.append(t)
        log(t)
        if t["rejected"] >= 0.99 * runs:
            return dict(detected=t, tried=tried)
    return dict(detected=None, tried=tried)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="512,2048", help="samples per request (default 512, the default size, and 2048)")
    ap.add_argument("--screen", type=int, default=20, help="runs per bisection screen (default 20)")
    ap.add_argument("--runs", type=int, default=100, help="runs that confirm a level (default 100)")
    ap.add_argument("--places", default=",".join(PLACES), help=f"where to plant (default: {', '.join(PLACES)})")
    ap.add_argument("--resume", action="store_true", help="keep the sizes already in OUT/sensitivity.json, run the rest")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    target, _ = toy_sampling_pair()
    command = "python benchmarks/sampled_sensitivity.py " + " ".join(sys.argv[1:])
    machine = describe_machine()
    results = []
    if a.resume and (out / "sensitivity.json").is_file():
        earlier = json.loads((out / "sensitivity.json").read_text())
        results = [r for r in earlier["results"] if str(r["samples"]) not in a.sizes.split(",")]
        command = f"{earlier['command']}; then {command}"
    for samples in (int(s) for s in a.sizes.split(",")):
        for place in a.places.split(","):
            positions = PLACES[place]

            def log(t, samples=samples, place=place):
                print(f"{samples:5d} {place:15s} tv {t['level']:<6} rejected {t['rejected']}/{t['runs']}  "
                      f"mean tv {t['mean_tv']:.4f}  ({t['seconds']:.0f} s)", flush=True)
            found = smallest_detected(target, positions, samples, a.screen, a.runs, log)
            results.append(dict(samples=samples, place=place, **found))
            write(out, command, machine, results)


def write(out: Path, command: str, machine: dict, results: list) -> None:
    (out / "sensitivity.json").write_text(json.dumps(dict(command=command, machine=machine, alpha=ALPHA,
                                                          levels=LEVELS, results=results), indent=1) + "\n")
    lines = ["# Sampled checker: the smallest deviation detected with probability 0.99", "",
             f"Command: `{command}`", f"Machine: {machine['summary']}", "",
             "Planted deviation: at the planted positions, mass moves from the most likely token to the runner-up "
             "(specbatch.conformance.sampling_engines.planted_engine); its mean total-variation distance per planted token is "
             "measured. 6 settings x 2 requests x SAMPLES samples of 8 tokens; toy pair "
             "specbatch.conformance.testing.toy_sampling_pair(); alpha 0.001.", "",
             "| samples per request | deviation at | detected in >= 99% of runs: mean TV per planted token | runs "
             "rejected | the level below: mean TV, rejected |", "|---:|---|---:|---:|---|"]
    for r in results:
        d = r["detected"]
        below = [t for t in r["tried"] if d and t["level"] < d["level"]]
        below = max(below, key=lambda t: t["level"]) if below else None
        lines.append(f"| {r['samples']} | {r['place']} | "
                     + (f"{d['mean_tv']:.3f} | {d['rejected']}/{d['runs']}" if d else "none up to 0.5 | -") + " | "
                     + (f"{below['mean_tv']:.3f}, {below['rejected']}/{below['runs']}" if below else "-") + " |")
    (out / "sensitivity.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
