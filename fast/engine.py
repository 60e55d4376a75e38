"""What every torch strategy shares: settings, statistics, timing, results, the draft loop, and
the checks of forwards and caches that the observer (fast.observer) runs."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from transformers import DynamicCache

from ..invariants import check_kv, check_mask, check_positions
from .compute.backend import CHOICES, Backend
from .compute.cache import layout_index, rect_inputs
from .models import ModelRunner
from .observer import Observer
from .policy import RoundInfo, RoundOutcome
from .proposals import ThresholdRule
from .sampling import Greedy


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
    observer: Observer = field(default_factory=Observer)  # fast.observer: invariant checks, trace rows
    chooser: object = field(default_factory=Greedy)  # fast.sampling: Greedy, Rejection or Coupled
    processors: object = None  # fast.processors.LogitProcessors (None: no penalties, bias, min_tokens or stops)
    arrivals: Arrivals | None = None  # when requests become available (None: all at once)
    policy: object = None  # fast.policy: FixedK, Threshold or Goodput (None: every row drafts its limit)
    backend: Backend = field(default_factory=lambda: CHOICES["cpu"])  # the device's speed choices (fast.compute.backend)
    tree_branches: int = 1  # candidates verified per drafted position (fast.trees; 1: chains)

    @property
    def reads_confidence(self) -> bool:
        """Whether rows stop drafting on their draft's confidence (fast.policy: not FixedK)."""
        return self.policy is not None and self.policy.reads_confidence

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
    verified_nodes: int = 0  # draft tokens the target verified (with trees, every node but the roots)
    leaves_verified: int = 0  # token trees: the leaves among them (nodes off the rows' chains)
    leaves_accepted: int = 0  # ... and those accepted (a row's accepted path ends at a leaf)
    lookup_rounds: int = 0  # rounds whose proposals all came from prompt lookup: no draft model forward
    time_total: float = 0.0
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_align: float = 0.0
    target_tokens_processed: int = 0
    draft_tokens_processed: int = 0
    proposed_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [j]: rows proposing a (j+1)-th token
    accepted_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [j]: rows accepting it
    extra: dict = field(default_factory=dict)

    def add_round(self, proposed, accepted, n, nodes: int | None = None, spine_accepted=None) -> None:
        """Account one round: each row's proposed drafts, accepted drafts (a prefix of its proposals,
        or a tree's accepted path) and committed tokens; nodes: draft tokens verified (a tree's nodes
        but the roots; default: the proposals); spine_accepted: a tree's accepted path nodes on the
        row's chain (a path longer than that ends at a leaf)."""
        self.rounds += 1
        self.verified_nodes += int(np.sum(proposed)) if nodes is None else int(nodes)
        self.leaves_verified += 0 if nodes is None else int(nodes) - int(np.sum(proposed))
        if spine_accepted is not None:
            self.leaves_accepted += int((np.asarray(accepted) > np.asarray(spine_accepted)).sum())
        self.row_rounds += len(n)
        self.drafted_tokens += int(np.sum(proposed))
        self.accepted_tokens += int(accepted.sum())
        self.generated_tokens += int(n.sum())
        grow = max(int(np.max(proposed, initial=0)) - len(self.proposed_at), 0)
        self.proposed_at, self.accepted_at = np.pad(self.proposed_at, (0, grow)), np.pad(self.accepted_at, (0, grow))
        position = np.arange(1, len(self.proposed_at) + 1)[None, :]
        self.proposed_at += (np.asarray(proposed)[:, None] >= position).sum(axis=0)
        self.accepted_at += (np.asarray(accepted)[:, None] >= position).sum(axis=0)

    def as_dict(self) -> dict:
        out = {name: getattr(self, name) for name in (
            "rounds", "drafted_tokens", "accepted_tokens", "generated_tokens", "lookup_rounds", "leaves_verified",
            "leaves_accepted", "time_total",
            "time_prefill", "time_draft", "time_verify", "time_align", "target_tokens_processed",
            "draft_tokens_processed")}
        out["mean_accepted_length"] = self.generated_tokens / self.row_rounds if self.row_rounds else 0.0
        out["nodes_per_row_round"] = self.verified_nodes / self.row_rounds if self.row_rounds else 0.0
        out["acceptance_rate"] = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
        out["tokens_per_second"] = self.generated_tokens / self.time_total if self.time_total else 0.0
        out["align_share"] = self.time_align / self.time_total if self.time_total else 0.0
        out["proposed_by_position"] = self.proposed_at.tolist()  # [j]: (j+1)-th proposals made
        out["accepted_by_position"] = self.accepted_at.tolist()  # [j]: ... and accepted
        out["acceptance_rate_by_position"] = [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]
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
    """Accumulates wall time into Stats fields; synchronises CUDA so phases are attributed right.

    agree(*seconds) -> seconds: what the proposal policy is told, the same on every rank of a
    tensor-parallel group (specbatch.tensor_parallel.clock_agreement); this process's own by default."""

    def __init__(self, stats: Stats, device: torch.device, agree=None):
        self.stats, self.cuda = stats, device.type == "cuda"
        self.last: dict = {}  # the latest duration of each phase (the proposal policy reads them)
        self.agree = agree or (lambda *seconds: seconds)

    @contextmanager
    def __call__(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.last[name] = time.perf_counter() - start
        setattr(self.stats, name, getattr(self.stats, name) + self.last[name])


@dataclass
class Proposals:
    """One round's drafting: drafted [R, steps] (tokens of every step run; a row's proposals are its
    first `proposed` ones, the rest are never accepted), q [R, steps, V] for rejection sampling, the
    confidences [R, steps] the rule saw (and their host copy where the rule read them), the rule
    (fast.proposals; its `limit` [R] as the round left it), the steps run and how many of them ran
    the draft model (the first `model_steps`; the others were lookup steps, see draft_round)."""

    drafted: torch.Tensor
    q: torch.Tensor | None
    confidence: torch.Tensor | None
    proposed: np.ndarray
    rule: object
    steps: int
    model_steps: int
    lookup_rows: np.ndarray  # rows that drafted by prompt lookup alone
    host_confidence: np.ndarray | None = None  # [R, steps] float64, where the rule read confidences
    siblings: torch.Tensor | None = None  # [R, steps, b - 1] each step's other candidates, a tree's leaves (fast.trees)
    leaves: np.ndarray | None = None  # [R, steps] the leading siblings of each step the rule put in the tree
    runner_ups: np.ndarray | None = None  # [R, steps, b - 1] host: what the rule priced the leaves by (or None)
    available: np.ndarray | None = None  # [R, steps] the siblings each step could offer (the rule's most)

    @property
    def limit(self) -> np.ndarray:
        return self.rule.limit

    @property
    def width(self) -> int:
        """Verify queries per row: the longest proposal plus the pending token."""
        return int(self.proposed.max()) + 1 if len(self.proposed) else 1


def draft_round(step_forward, settings: Settings, clamp: np.ndarray, requests, content, device,
                lookup_step=None, remaining=None, waiting: bool = True) -> Proposals:
    """Run the draft step by step and apply the round's proposal rule (fast.proposals, chosen by
    the policy, fast.policy) to each row.

    step_forward(step, ids, needed) -> the draft's logits [R, V] at each row's last query (or
    SubsetLogits, fast.drafts.reduced_head); ids is None at step 0 (the engine feeds each row's pending
    tokens), then the previous proposals [R, 1]; needed [R] (host bools): the rows whose logits
    this step are read, the model rows still drafting (a draft whose rows are independent computes
    only those; every other row's logits are never read, since a row that stops drafting never
    resumes in the round and a lookup row takes the lookup's token). clamp: each row's min(k,
    remaining - 1). Drafting stops as soon as no row goes on. remaining (each row's tokens left) and
    waiting (whether requests wait for a slot) tell the policy what a token is worth.

    lookup_step(step, ids) -> fast.drafts.lookup_draft.LookupStep, for a lookup-first draft
    (fast.proposer.LookupFirst): its prompt lookup over each row's content and proposals so far. A row
    whose lookup matches at step 0 drafts this round by lookup alone, until the chain of matches
    breaks (a function of its own content, like any draft); the model runs only while another row
    drafts, and its cache catches up through its pending tokens. In a model row's later steps a
    match's token is the proposal (the lookup-first draft's own rule, run here: engine_lookup=True)."""
    clamp = np.asarray(clamp, dtype=np.int64)
    rows = len(clamp)
    rule = _round_rule(settings, clamp, requests, remaining, waiting)
    steps, dists, confidences, host, siblings, leaves, runner_ups, available = [], [], [], [], [], [], [], []
    active, proposed = rule.limit > 0, np.zeros(rows, dtype=np.int64)
    ids, lookup_rows, model_steps = None, np.zeros(rows, dtype=bool), 0
    for step in range(int(rule.limit.max(initial=0))):
        found = lookup_step(step, ids) if lookup_step is not None else None
        if step == 0:  # one small host copy: which rows draft by lookup
            lookup_rows = (found.matched > 0).cpu().numpy() if found is not None else lookup_rows
            active = rule.begin(~lookup_rows)
            if not active.any():
                break
        needed = active & ~lookup_rows
        if needed.any():
            logits = step_forward(step, ids, needed)
            model_steps = step + 1
            token, dist, confidence = _choose_drafts(settings, logits, requests, content + step, found, lookup_rows,
                                                     steps, device)
        elif found is not None:  # lookup rows alone: no model, and greedy builds no [R, V] logits
            logits = None
            token, dist, confidence = settings.chooser.draft_lookup(found, requests, content + step)
        else:
            break  # no row may draft this round
        if settings.tree_branches > 1:
            for kept, part in zip((runner_ups, available), _leaf_prices(settings, rule, logits, requests, found,
                                                                        lookup_rows)):
                kept.append(part)
        ids = token[:, None]
        steps.append(ids)
        dists.append(dist)
        confidences.append(confidence)
        seen = None
        if rule.needs_confidence:  # one small host copy per step: which rows propose, and which go on
            seen = confidence.double().cpu().numpy()  # compared as the checker (I7) compares
            host.append(seen)
        proposes, active = rule.step(step, seen, active)
        proposed += proposes
        if settings.tree_branches > 1:
            leaves.append(rule.leaves(step, runner_ups[-1], proposes, available[-1]))
            siblings.append(_siblings(settings, logits, dist, token, requests, content + step, found, lookup_rows,
                                      leaves[-1].any()))
        if not active.any():
            break
    q = _stacked(dists) if settings.chooser.needs_q else None
    return Proposals(_so_far(steps, rows, device), q, _stacked(confidences), proposed, rule, len(steps), model_steps,
                     lookup_rows, np.stack(host, axis=1) if host else None, _stacked(siblings),
                     np.stack(leaves, axis=1) if leaves else None,
                     np.stack(runner_ups, axis=1) if leaves and rule.decides_leaves else None,
                     np.stack(available, axis=1) if leaves else None)


def _leaf_prices(settings: Settings, rule, logits, requests, found, lookup_rows):
    """What the proposal rule needs to choose one step's tree leaves (fast.trees), on the host (small
    copies): the runner-up probabilities [R, b - 1] where the rule prices leaves (the goodput rule;
    else None) and available [R], the candidates each row has: b - 1 on a model row; on a lookup
    row, the other followers its lookup found (fast.drafts.lookup_draft.other_followers), priced by
    their shares, where the step brings them (found.others: greedy and coupled), and none elsewhere.
    logits None: a step of lookup rows alone."""
    most = settings.tree_branches - 1
    runner_ups = None
    if rule.decides_leaves:
        runner_ups = np.zeros((len(lookup_rows), most)) if logits is None else \
            settings.chooser.runner_ups(logits, requests, most).double().cpu().numpy()
    available = np.where(lookup_rows, 0, most)
    if _has_lookup_leaves(found, lookup_rows):
        shares = found.shares.double().cpu().numpy()
        available = np.where(lookup_rows, (shares > 0).sum(axis=1), most)
        if runner_ups is not None:
            runner_ups = np.where(lookup_rows[:, None], shares, runner_ups)
    return runner_ups, available


def _siblings(settings: Settings, logits, dist, token, requests, positions, found, lookup_rows, any_leaf: bool):
    """[R, b - 1] one step's candidates beside each proposal, the leading ones of which are the
    row's leaves there: the chooser's on a model row, the lookup's other followers on a lookup row.
    Computed only where the rule gave some row a leaf this step (else copies of the proposals,
    never read)."""
    most = settings.tree_branches - 1
    siblings = token[:, None].expand(-1, most)
    if not any_leaf:
        return siblings
    if logits is not None:
        siblings = settings.chooser.siblings(logits, dist, token, requests, positions, most)
    if _has_lookup_leaves(found, lookup_rows):
        siblings = torch.where(torch.as_tensor(lookup_rows, device=token.device)[:, None], found.others, siblings)
    return siblings


def _has_lookup_leaves(found, lookup_rows) -> bool:
    """Whether this step's lookup brought other followers (greedy, coupled) and some row drafts by lookup."""
    return found is not None and found.others is not None and bool(lookup_rows.any())


def _round_rule(settings: Settings, clamp: np.ndarray, requests, remaining, waiting: bool):
    """The round's proposal rule: the policy's plan for these rows (the threshold rule without a policy)."""
    if settings.policy is None:
        return ThresholdRule(clamp)
    remaining_host = None if remaining is None else np.asarray(remaining)
    return settings.policy.plan(RoundInfo(np.asarray(requests.tolist()), clamp, remaining_host, waiting))


def _choose_drafts(settings: Settings, logits, requests, index, found, lookup_rows, steps: list, device):
    """One draft step's (token, q, confidence) per row from the draft's logits: where the lookup matched
    (lookup rows always), the lookup's token. Processors (penalties) see the round's proposals so far."""
    prefix = {} if settings.processors is None else dict(prefix=_so_far(steps, len(lookup_rows), device))
    if found is None:
        return settings.chooser.draft(logits, requests, index, **prefix)
    use = torch.as_tensor(lookup_rows, device=found.matched.device) | (found.matched > 0)
    return settings.chooser.draft(logits, requests, index, found, use, **prefix)


def _stacked(per_step: list):
    """A round's per-step tensors [R, ...] as one [R, s, ...], or None when no step ran."""
    return torch.stack(per_step, dim=1) if per_step else None


def _so_far(steps: list, rows: int, device) -> torch.Tensor:
    """The proposals of a round's earlier steps [R, s]."""
    return torch.cat(steps, dim=1) if steps else torch.zeros(rows, 0, dtype=torch.long, device=device)


def record_round(settings: Settings, clock, requests, proposals: Proposals, accepted, verify_tokens: int,
                 spine_accepted=None) -> None:
    """Tell the policy (if any) what the round proposed, accepted and cost (seconds as clock.agree
    gives them, so that the ranks of a tensor-parallel group plan alike). A tree round's accepted
    [R] is its path's length and spine_accepted [R] the path's leading spine nodes (None: a chain)."""
    if settings.policy is None:
        return
    draft_seconds, verify_seconds, ended = clock.agree(clock.last.get("time_draft", 0.0),
                                                       clock.last.get("time_verify", 0.0), time.perf_counter())
    accepted = np.asarray(accepted)
    spine = accepted if spine_accepted is None else np.asarray(spine_accepted)
    leaf_confidence, leaves_accepted = leaf_outcome(proposals, accepted, spine)
    settings.policy.record(RoundOutcome(np.asarray(requests), proposals.proposed, spine,
                                        proposals.host_confidence, proposals.model_steps, draft_seconds,
                                        verify_tokens, verify_seconds, proposals.lookup_rows,
                                        leaf_confidence=leaf_confidence, leaves_accepted=leaves_accepted,
                                        ended=ended))


def leaf_outcome(proposals: Proposals, accepted: np.ndarray, spine: np.ndarray):
    """Per row [R] (None without priced leaves): the runner-up probabilities summed over a tree
    round's reached leaves (those under a spine node on the accepted path or the root: step j <=
    spine_i), and its accepted leaves (1 where the path left the spine: it ends at a leaf)."""
    if proposals.leaves is None or proposals.runner_ups is None:
        return None, None
    leaves, runner_ups = proposals.leaves, proposals.runner_ups
    reached = np.arange(leaves.shape[1])[None, :] <= spine[:, None]  # [R, steps]
    included = np.arange(runner_ups.shape[2])[None, None, :] < (leaves * reached)[:, :, None]
    return np.where(included, runner_ups, 0.0).sum(axis=(1, 2)), (accepted > spine).astype(float)


def check_rect_forward(pad_len: torch.Tensor, first_col: int, position_ids, mask, window) -> list:
    """I2 and I4 for one rectangular forward; expected indices come from the lengths alone."""
    slot = layout_index(pad_len, first_col + position_ids.shape[1])
    query = slot[:, first_col:]
    return check_positions(position_ids, query) + check_mask(mask, query, slot, window)


def fresh_kv(runner: ModelRunner, content: list[int], settings: Settings, features=None) -> list:
    """K/V per layer ([T, H, D] keys and values) of an unpadded batch-1 prefill of `content`."""
    ids = torch.tensor([content], device=settings.device)
    pos, mask = rect_inputs(torch.zeros(1, dtype=torch.long, device=settings.device), 0, len(content),
                            settings.window, settings.dtype, settings.fill)
    cache = DynamicCache()
    tokens_before = runner.tokens_processed
    runner(ids, pos, mask, cache, **({} if features is None else {"features": features}))
    runner.tokens_processed = tokens_before  # checking is not work
    return [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in cache.layers]


def check_cache_row(runner, layer_kv, row: int, content: list[int], first_slot: int, settings: Settings,
                    name: str, features=None) -> list:
    """I3 for one row: layer_kv(layer) -> (keys, values) [S, H, D] of the row's slots; slots
    first_slot.. must hold the K/V of content[0..] exactly as a fresh unpadded prefill computes them
    (a feature draft's prefill reads `features` [1, len(content), H], fast.drafts.feature_draft)."""
    if not content:
        return []
    fresh = fresh_kv(runner, content, settings, features)
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


def rect_queries(positions, mask, proposed) -> list:
    """Per row, the position ids and visible slots of its own verify queries (the first p_i + 1
    columns of a rectangular verify; the rest are never accepted)."""
    positions, visible = positions.cpu().numpy(), (mask[:, 0] == 0).cpu().numpy()
    return [(positions[i, :p + 1], visible[i, :p + 1]) for i, p in enumerate(proposed)]



