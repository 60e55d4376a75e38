"""What every torch strategy shares: settings, statistics, timing, results, and the per-round
invariant checks and trace rows (check_invariants=True / trace=path)."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache

from ..invariants import (TraceWriter, check_kv, check_mask, check_positions, check_round_commit,
                          mask_strings, raise_if)
from .cache import layout_index, rect_inputs
from .models import ModelRunner
from .sampling import Greedy
from .verify import committed_lists


class Arrivals:
    """Releases requests to a scheduler once their arrival time has come (offsets in seconds from
    the start, nondecreasing in request order); without offsets every request is there at once."""

    def __init__(self, count: int, offsets=None):
        self.count, self.offsets, self.released = count, offsets, 0
        self.start = time.perf_counter()

    def due(self) -> list[int]:
        if self.offsets is None:
            upto = self.count
        else:
            now = time.perf_counter() - self.start
            upto = self.released
            while upto < self.count and self.offsets[upto] <= now:
                upto += 1
        out, self.released = list(range(self.released, upto)), upto
        return out

    def pending(self) -> bool:
        return self.released < self.count

    def wait(self) -> None:
        """Sleep until the next request arrives (nothing else to do)."""
        if self.pending() and self.offsets is not None:
            time.sleep(max(0.0, self.offsets[self.released] - (time.perf_counter() - self.start)))


@dataclass
class Settings:
    """Everything a strategy needs besides the models and the requests."""

    k: int  # draft tokens per round (0: target-only decoding)
    eos_ids: tuple
    window: int | None  # sliding attention window applied by position, or None
    dtype: torch.dtype
    device: torch.device
    fill: float  # additive mask value of a hidden slot
    pad_id: int = 0
    check: bool = False
    trace: TraceWriter | None = None
    chooser: object = field(default_factory=Greedy)  # fast.sampling: Greedy, Rejection or Coupled
    arrivals: Arrivals | None = None  # when requests become available (None: all at once)

    @property
    def eos(self) -> torch.Tensor:
        return torch.tensor(self.eos_ids, dtype=torch.long, device=self.device)


@dataclass
class Stats:
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    row_rounds: int = 0  # sum over rounds of the rows in the round
    time_total: float = 0.0
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_align: float = 0.0
    target_tokens_processed: int = 0
    draft_tokens_processed: int = 0
    extra: dict = field(default_factory=dict)

    def add_round(self, k: int, accepted, n) -> None:
        """Account one round: k drafts for each of len(n) rows, their accepted and committed counts."""
        self.rounds += 1
        self.row_rounds += len(n)
        self.drafted_tokens += k * len(n)
        self.accepted_tokens += int(accepted.sum())
        self.generated_tokens += int(n.sum())

    def as_dict(self) -> dict:
        out = {name: getattr(self, name) for name in (
            "rounds", "drafted_tokens", "accepted_tokens", "generated_tokens", "time_total", "time_prefill",
            "time_draft", "time_verify", "time_align", "target_tokens_processed", "draft_tokens_processed")}
        out["mean_accepted_length"] = self.generated_tokens / self.row_rounds if self.row_rounds else 0.0
        out["acceptance_rate"] = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
        out["tokens_per_second"] = self.generated_tokens / self.time_total if self.time_total else 0.0
        out["align_share"] = self.time_align / self.time_total if self.time_total else 0.0
        out.update(self.extra)
        return out


@dataclass
class GenerationResult:
    sequences: list  # new tokens per prompt, input order, cut after the first EOS (kept)
    stop_reasons: list  # "eos" or "length" per prompt
    stats: dict
    texts: list | None = None  # decoded sequences when a tokenizer was given
    request_stats: list | None = None  # per request: rounds it ran, accepted_length (tokens per round)


class Clock:
    """Accumulates wall time into Stats fields; synchronises CUDA so phases are attributed right."""

    def __init__(self, stats: Stats, device: torch.device):
        self.stats, self.cuda = stats, device.type == "cuda"

    @contextmanager
    def __call__(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        setattr(self.stats, name, getattr(self.stats, name) + time.perf_counter() - start)


def check_rect_forward(pad_len: torch.Tensor, first_col: int, position_ids, mask, window) -> list:
    """I2 and I4 for one rectangular forward; expected indices come from the lengths alone."""
    slot = layout_index(pad_len, first_col + position_ids.shape[1])
    query = slot[:, first_col:]
    return check_positions(position_ids, query) + check_mask(mask, query, slot, window)


def fresh_kv(runner: ModelRunner, content: list[int], settings: Settings) -> list:
    """K/V per layer ([T, H, D] keys and values) of an unpadded batch-1 prefill of `content`."""
    ids = torch.tensor([content], device=settings.device)
    pos, mask = rect_inputs(torch.zeros(1, dtype=torch.long, device=settings.device), 0, len(content),
                            settings.window, settings.dtype, settings.fill)
    cache = DynamicCache()
    tokens_before = runner.tokens_processed
    runner(ids, pos, mask, cache)
    runner.tokens_processed = tokens_before  # checking is not work
    return [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in cache.layers]


def check_cache_row(runner, layer_kv, row: int, content: list[int], first_slot: int, settings: Settings,
                    name: str) -> list:
    """I3 for one row: layer_kv(layer) -> (keys, values) [S, H, D] of the row's slots; slots
    first_slot.. must hold the K/V of content[0..] exactly as a fresh unpadded prefill computes them."""
    if not content:
        return []
    fresh = fresh_kv(runner, content, settings)
    tol = dict(rtol=1e-6, atol=1e-8) if settings.dtype == torch.float64 else dict(rtol=2e-3, atol=2e-4)
    found = []
    for layer, (k_fresh, v_fresh) in enumerate(fresh):
        for part, stored, want in zip("KV", layer_kv(layer), (k_fresh, v_fresh)):
            index = (torch.arange(stored.shape[0]) - first_slot)[None]
            found += [replace(v, row=row) for v in check_kv(stored[None], index, [len(content)], lambda _: want,
                                                             rows=[0], name=f"{name} layer {layer} {part}", **tol)]
    return found


def dynamic_layer_kv(cache: DynamicCache, row: int):
    """layer_kv for a DynamicCache: (keys, values) of one row as [S, H, D]."""
    return lambda layer: (cache.layers[layer].keys[row].transpose(0, 1), cache.layers[layer].values[row].transpose(0, 1))


def observe_round(settings: Settings, found: list, round_index: int, rows: dict, pos, mask, drafted, choice, limit,
                  accepted, n, remaining, finished) -> None:
    """check_invariants (I5, I6 of the commit) and trace output of one round, for any layout.

    rows: requests, prompt_len, tokens, pad_len and content_len of the round's rows (host or device)."""
    if not (settings.check or settings.trace is not None):
        return
    committed = committed_lists(choice, n)
    if settings.check:
        found += check_round_commit(drafted.cpu().numpy(), choice.cpu().numpy(), limit, accepted, committed,
                                    remaining, settings.eos_ids)
    if settings.trace is not None:
        settings.trace.round(round_index, trace_rows(
            rows["requests"], rows["prompt_len"], rows["tokens"], rows["pad_len"], rows["content_len"], pos, mask,
            drafted, choice, limit, accepted, committed, finished))


def trace_rows(requests, prompt_len, tokens, pad_len, content_len, positions, mask, drafted, choice, limit,
               accepted, committed, finished) -> list[dict]:
    """Rows of one round in the trace format (invariants.trace); host copies made only when tracing."""
    tokens, positions, drafted, choice = (t.cpu().numpy() for t in (tokens, positions, drafted, choice))
    visible = (mask[:, 0] == 0).cpu().numpy()
    return [dict(request=int(requests[i]), prompt_len=int(prompt_len[i]), tokens=tokens[i].tolist(),
                 pad_len=int(pad_len[i]), content_len=int(content_len[i]), positions=positions[i].tolist(),
                 mask=mask_strings(visible[i]), drafted=drafted[i].tolist(), target_argmax=choice[i].tolist(),
                 draft_limit=int(limit[i]), accepted=int(accepted[i]), committed=list(committed[i]),
                 finished=bool(finished[i])) for i in range(len(requests))]


raise_violations = raise_if

