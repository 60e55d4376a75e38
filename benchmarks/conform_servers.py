"""Verdicts on real inference servers: start one on 127.0.0.1, send it the conformance vectors
through `specbatch.conformance.serving` (as `specbatch conform run --server` does), stop it, judge, and write
the outputs and a verdict file with the machine.

    python benchmarks/conform_servers.py --label llama-f32-spec --out-dir docs/results/servers \
        --vectors vectors/ [--sampled sampled/ --no-seeds] [--against REF.jsonl] [--concurrency 8] \
        [--logprobs 5] [--api openai|llama.cpp] -- SERVER COMMAND WITH {port}

The server command's `{port}` is replaced by a free port; it must listen on 127.0.0.1 and is
stopped (SIGTERM, then SIGKILL) when the vectors are done, on an error, or after --max-seconds.
Greedy vectors are judged against the vectors' reference (transformers, batch 1) and, with
--against, against the engine's own reference run (an earlier label's outputs, made with
--concurrency 1 and --logprobs); sampled vectors against the target's distribution
(--target, default smollm2). Examples (README, docs/verify-your-engine.md):

    llama.cpp:  -- llama-server -m target-f32.gguf [-md draft-f32.gguf --spec-draft-n-max 4] \
                   --host 127.0.0.1 --port {port} -t 2 -np 8 -c 16384
    vLLM:       -- VENV/bin/vllm serve MODEL_DIR --host 127.0.0.1 --port {port} --dtype float32 \
                   --enforce-eager --max-model-len 2048 [--speculative-config '{...}']
"""
import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, process, seconds: float) -> float:
    """Seconds until GET /health answers 200 (the server's log is in the out dir otherwise)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server was not ready within {seconds:.0f} s")


def stop(process) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--vectors", help="greedy vectors folder")
    ap.add_argument("--sampled", help="sampled vectors folder")
    ap.add_argument("--against", help="greedy: the engine's own reference outputs (differential check)")
    ap.add_argument("--api", default="openai", choices=("openai", "llama.cpp"))
    ap.add_argument("--model", default=None, help="the model name the server wants in requests")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--no-seeds", action="store_true")
    ap.add_argument("--samples", type=int, help="sampled: only the first N samples of each request")
    ap.add_argument("--settings", help="sampled: only these settings (comma-separated names)")
    ap.add_argument("--check-logprobs", choices=("raw", "processed"), help="sampled: also judge the logprob the "
                    "server returned for each sampled token (ask for them with --logprobs 1 or more)")
    ap.add_argument("--target", default="smollm2", help="sampled: the model whose distribution is the reference")
    ap.add_argument("--max-seconds", type=float, default=3600.0, help="the server is stopped after this long")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the server command, with {port}")
    a = ap.parse_args()
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        ap.error("give the server command after --")
    from specbatch.cli.machine import describe_machine
    from specbatch.conformance.serving import ServerEngine, ServerError

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [part.replace("{port}", str(port)) for part in command]
    log = open(out / f"{a.label}.server.log", "w")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    timer = time.monotonic()
    verdict = dict(label=a.label, server_command=shlex.join(map(portable, argv)),
                   command="python benchmarks/conform_servers.py " + shlex.join(map(portable, sys.argv[1:])),
                   api=a.api, concurrency=a.concurrency, machine=describe_machine())
    url = f"http://127.0.0.1:{port}"
    try:
        verdict["ready_s"] = round(wait_ready(url, process, min(600.0, a.max_seconds)), 1)
        engine = ServerEngine(url, a.api, model=a.model, logprobs=a.logprobs, seeds=not a.no_seeds,
                              timeout=min(600.0, a.max_seconds))
        verdict["limits"] = list(engine.limits)
        if a.vectors:
            verdict["greedy"] = greedy_part(engine, a, out)
        if a.sampled:
            verdict["sampled"] = sampled_part(engine, a, out, lambda: stop(process))
    except ServerError as e:  # the server failed a request: the verdict file says so
        verdict["server_error"] = str(e)
    finally:
        stop(process)
        log.close()
        verdict["total_s"] = round(time.monotonic() - timer, 1)
        (out / f"{a.label}.verdict.json").write_text(json.dumps(verdict, indent=1) + "\n")
    print(json.dumps({k: v for k, v in verdict.items() if k not in ("machine",)}, indent=1)[:4000])


def greedy_part(engine, a, out) -> dict:
    """Greedy vectors through the server, judged against the vectors' reference and, with
    --against, the engine's own reference run."""
    from specbatch.conformance.greedy import check_outputs, differential_reference, load_vectors, read_outputs
    from specbatch.conformance.serving import run_vectors
    vectors = load_vectors(a.vectors)
    start = time.perf_counter()
    rows = run_vectors(engine, vectors, concurrency=a.concurrency)
    greedy = dict(requests=len(rows), wall_s=round(time.perf_counter() - start, 1))
    (out / f"{a.label}.greedy.jsonl").write_text("".join(json.dumps(rows[r["id"]]) + "\n" for r in vectors.requests))
    greedy["vs_transformers"] = summary(check_outputs(vectors, list(rows.values())))
    if a.against:
        report = check_outputs(vectors, list(rows.values()),
                               reference=differential_reference(vectors, read_outputs(a.against)[0]))
        greedy["differential"] = dict(summary(report), against=Path(a.against).name, tolerance=report.tolerance)
    return greedy


def sampled_part(engine, a, out, stop_server) -> dict:
    """Sampled vectors (or --samples/--settings of them) through the server; the server is stopped
    before the checker loads the target."""
    import specbatch
    from specbatch.conformance.sampled import check_samples, load_sampled_vectors
    from specbatch.conformance.serving import run_vectors
    vectors = load_sampled_vectors(a.sampled).subset(a.samples, a.settings and a.settings.split(","))
    start = time.perf_counter()
    rows = run_vectors(engine, vectors, concurrency=a.concurrency)
    wall = time.perf_counter() - start
    (out / f"{a.label}.sampled.jsonl").write_text("".join(json.dumps(rows[r["id"]]) + "\n" for r in vectors.rows))
    stop_server()
    target, _, _ = specbatch.load(a.target, dtype=vectors.manifest["dtype"])
    start = time.perf_counter()
    report = check_samples(vectors, list(rows.values()), target, batch_size=a.concurrency, logprobs=a.check_logprobs)
    return dict(rows=len(rows), samples=vectors.manifest["samples"], settings=[s["name"] for s in vectors.settings()],
                wall_s=round(wall, 1), check_s=round(time.perf_counter() - start, 1), conformant=report.conformant,
                p=report.p_value(), violations=len(report.violations), table=report.table(),
                logprobs_checked=report.logprobs_checked, logprob_errors=len(report.logprob_errors),
                lines=report.lines()[:20])


def portable(arg: str) -> str:
    """A path as its file name (results record no machine's folders); other arguments as they are."""
    return os.path.basename(arg) if os.path.isabs(arg) else arg


def summary(report) -> dict:
    counts = {v: sum(r["verdict"] == v for r in report.requests) for v in ("exact", "tie", "algorithmic", "missing")}
    return dict(conformant=report.conformant, **counts, divergences=report.lines()[:12], table=report.table())


if __name__ == "__main__":
    main()
