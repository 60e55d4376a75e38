"""Row counts and kernels for the linear products, chosen from their measured cost on this machine.

oneDNN blocks its kernels by row count, so a product of n rows can cost more than one of m > n
rows: a decoding step's products at one row took 33.0 ms and at four rows 22.9 ms on an AVX-512
EPYC, and an Intel Xeon's 49,152-row head cost twice as much at 13 rows as at 16. Which row counts
pay to pad, and to what, depends on the CPU, the threads, the weights' shape and dtype; so it is
measured, never assumed:

- a *shape class* is every prepacked weight of one shape and dtype (the 30 layers' gate/up
  products of SmolLM2 are one class, its head another);
- the first time a forward brings n rows (n <= MAX_ROWS) to a class, each candidate m in
  n .. n + 3 is timed as the forward would run n rows padded to m (copies of row 0 fill the
  rest, one product per weight of a sample of SAMPLE weights of the class, the first n rows
  kept), REPEATS passes interleaved so that a machine slowing down slows every candidate alike;
  a decision costs well under a second, and `kernels.prepare_row_plans` makes them all before a
  benchmark times anything;
- n is padded to the candidate of least median time only if every pass at that candidate beat
  every pass at n: noise never pads;
- whether n rows run torch's own product on the unpacked weight (`F.linear`) instead of the packed
  one is decided per class too, but timed over a whole step: passes over every weight of every
  class in the order a forward reads them, once with each kernel (alternating), each class's own
  products timed within (kernels.step_timer). A few weights timed alone stay in the CPU's caches,
  while a step streams every weight from memory: on an Intel Xeon with a 480 MB L3 a step's
  float32 products at one row took 20.6 ms plain and 23.7 ms packed streaming, and the two within
  noise on a few weights. The plain product is chosen only where every pass beat every packed
  pass;
- the decisions and times are kept on disk (row-plans/ in the specbatch cache folder, one file per
  machine: CPU model, capability, threads, torch version), so a machine measures once.

Beyond MAX_ROWS rows (prefill chunks of hundreds of rows) the products are compute-bound and grow
smoothly with the rows; they are never padded. Padding changes no row's product beyond rounding:
each row comes back as oneDNN computes it within m rows (tests/test_kernels.py).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

MAX_ROWS = 64  # the row counts of decoding and verifying steps (batch x proposals); larger: never padded
REPEATS = 3
SAMPLE = 4  # weights of a class timed per pass: equal shapes cost alike, and a pass stays above timer noise
FORMAT = 2  # of the saved decisions: a file of another format (without the kernel decisions) is measured again


def candidates(rows: int) -> range:
    """The padded row counts tried for `rows` (itself included)."""
    return range(rows, rows + 4)  # 1 -> 4, 2 -> 3 and 13 -> 16 are the cases measured to pay


def cheapest(rows: int, passes: dict) -> int:
    """The row count `rows` is padded to, from passes[m] (seconds of each timed pass of `rows` rows
    padded to m): the
    candidate of least median time, if each of its passes beat each pass at `rows`; else `rows`."""
    best = min(candidates(rows), key=lambda m: (statistics.median(passes[m]), m))
    return best if max(passes[best]) < min(passes[rows]) else rows


def padded_product(x: torch.Tensor, packed, bias, padded: int) -> torch.Tensor:
    """x [..., in] times the packed weight, computed as a product of `padded` rows (copies of the
    first row fill the rest, and are dropped)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    flat = x.reshape(rows, x.shape[-1])
    flat = torch.cat([flat, flat[:1].expand(padded - rows, -1)])
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


PLAIN = 0  # product()'s plan for torch's own product on the unpacked weight


def product(x: torch.Tensor, weight: torch.Tensor, packed, bias, plan: int) -> torch.Tensor:
    """x [..., in] times the weight: torch's product on `weight` (plan PLAIN), or the packed one with
    the rows padded to `plan`."""
    if plan == PLAIN:
        return torch.nn.functional.linear(x, weight, bias)
    return padded_product(x, packed, bias, plan)


@functools.lru_cache(maxsize=1)
def _cpu() -> str:
    from ...cli.machine import cpu_info
    return f"{cpu_info()['model']} | {torch.backends.cpu.get_cpu_capability()}"


def machine_key() -> str:
    """What the measured costs depend on besides the shapes: CPU model, capability, threads, torch."""
    return f"{_cpu()} | {torch.get_num_threads()} threads | torch {torch.__version__}"


class RowPlans:
    """Padding decisions for every shape class, measured on demand and kept in `path` (None: in
    memory only). Thread-safe: a forward on another thread waits for a measurement under way."""

    def __init__(self, path: Path | None, machine: str):
        self.path, self.machine = path, machine
        self.lock = threading.Lock()
        self.classes: dict = {}  # class key -> {"padded": {n: m}, "passes": {n: {m: [seconds, ...]}}}
        if path is not None and path.exists():
            try:
                saved = json.loads(path.read_text())
                if saved.get("machine") == machine and saved.get("format") == FORMAT:
                    self.classes = {k: dict(padded={int(n): m for n, m in v["padded"].items()},
                                            passes={int(n): {int(m): p for m, p in by_m.items()}
                                                    for n, by_m in v["passes"].items()},
                                            plain={int(n): bool(b) for n, b in v["plain"].items()},
                                            kernel_passes={int(n): p for n, p in v["kernel_passes"].items()})
                                    for k, v in saved["classes"].items()}
            except (OSError, ValueError, KeyError, AttributeError):
                self.classes = {}  # an unreadable file is measured again, and replaced

    def _entry(self, key: str) -> dict:
        return self.classes.setdefault(key, dict(padded={}, passes={}, plain={}, kernel_passes={}))

    @staticmethod
    def class_key(weight: torch.Tensor) -> str:
        return f"{tuple(weight.shape)} {str(weight.dtype).removeprefix('torch.')}"

    def rows_for(self, key: str, rows: int, time_pass) -> int:
        """The row count to run `rows` rows of class `key` at; time_pass(rows, m) -> seconds of one
        pass over the class of `rows` rows padded to m, called only for a row count not yet decided."""
        if rows > MAX_ROWS or rows < 1:
            return rows
        known = self.classes.get(key, {}).get("padded", {})
        if rows in known:
            return known[rows]
        with self.lock:
            entry = self._entry(key)
            if rows not in entry["padded"]:
                passes = {m: [] for m in candidates(rows)}
                for m in passes:
                    time_pass(rows, m)  # warm: the first pass at a new count sets up oneDNN's kernel
                for _ in range(REPEATS):
                    for m in passes:
                        passes[m].append(time_pass(rows, m))
                entry["passes"][rows] = passes
                entry["padded"][rows] = cheapest(rows, passes)
                self._save()
            return entry["padded"][rows]

    def plain_for(self, key: str, rows: int, time_step) -> bool:
        """Whether `rows` rows of class `key` run torch's own product on the unpacked weight (else the
        packed one); time_step(rows) -> {class key: (plain seconds, packed seconds) per pass} over a
        whole step, called only for a row count not yet decided, and deciding every class it times."""
        if not 1 <= rows <= MAX_ROWS:  # prefill chunks, empty forwards: the packed kernel, never timed
            return False
        known = self.classes.get(key, {}).get("plain", {})
        if rows in known:
            return known[rows]
        with self.lock:
            if rows not in self._entry(key)["plain"]:
                for timed, (plain, packed) in time_step(rows).items():
                    entry = self._entry(timed)
                    if rows not in entry["plain"]:
                        entry["plain"][rows] = max(plain) < min(packed)
                        entry["kernel_passes"][rows] = dict(plain=plain, packed=packed)
                self._entry(key)["plain"].setdefault(rows, False)  # a class the step did not time
                self._save()
            return self.classes[key]["plain"][rows]

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps(dict(machine=self.machine, format=FORMAT, classes=self.classes), indent=1)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False) as tmp:
                tmp.write(text)
            os.replace(tmp.name, self.path)
        except OSError:
            pass  # a read-only cache folder: the decisions stay in memory


def class_timer(packed_weights: list, in_features: int, dtype):
    """time_pass for a shape class: one product per weight of a sample of SAMPLE of them, `rows` rows
    padded to `padded`, as the forward runs it."""
    sample = packed_weights[:SAMPLE]

    def time_pass(rows: int, padded: int) -> float:
        x = torch.randn(rows, in_features).to(dtype)
        start = time.perf_counter()
        for packed in sample:
            padded_product(x, packed, None, padded)
        return time.perf_counter() - start
    return time_pass


_PLANS: RowPlans | None = None


def plans() -> RowPlans:
    """This process's RowPlans, read from the cache folder's file for this machine on first use."""
    global _PLANS
    machine = machine_key()
    if _PLANS is None or _PLANS.machine != machine:  # torch.set_num_threads changes the machine
        from ..loading import cache_dir
        name = hashlib.sha256(machine.encode()).hexdigest()[:16]
        _PLANS = RowPlans(cache_dir() / "row-plans" / f"{name}.json", machine)
    return _PLANS
