"""How far each row drafts in a round: its proposal length p_i, 0..k.

The rule (proofs_notes/proposals.md), evaluated step by step while drafting:

    limit_i = min(k, remaining_i - 1, cap_i)      budget clamp, and the row's cap this round
    row i proposes its (j+1)-th token at draft step j  <=>  j < limit_i,
        confidence_ij' >= threshold at every earlier step j' < j, and confidence_ij >= floor

where confidence_ij is the probability of the most likely token of the row's (processed) draft
distribution at step j: a function of the row's own visible content and the draft, never of the
token drawn and never of another row. The threshold decides whether a row goes on drafting; the
floor (<= threshold) whether the step that stops it still proposes its token: that token is already
computed, and at batch 1 its verify costs ~1 ms of a ~45 ms round (floor = threshold: never; the
controller raises the round's floor to the threshold from FLOOR_BELOW_ROWS rows up to shallow
rounds, below). A row that proposes nothing gets exactly one target token;
a round in which no row proposes is a plain target step; the verify covers each row's own
proposals only (a flat forward in the ragged layout; in rectangular layouts the longer rows' width,
whose extra columns the shorter rows never accept: their limit is their own p_i).

`cap` is k unless the cost-aware controller (DraftController, adaptive=True) lowers it. From
SHALLOW_FROM_ROWS rows up every round is shallow: each row's cap is 1, so every row whose first
draft token is at least as likely as the run's floor proposes it, and the draft runs one step.
Below that, the controller fits
the measured seconds of draft steps and verify forwards to the batch size and the number of
verified tokens, estimates each row's chance to be accepted from the row's own recent history,
gives each row the cap whose proposals are expected to pay for their verify tokens, and runs only
the draft steps whose measured yield pays for them (from TRIM_FROM_ROWS rows up); a round where
every cap is 0 is a plain target step. Lookup rows (engine.draft_round) draft without model steps,
so their cap is the one their verify tokens pay for; from LONG_MATCH_FROM_ROWS rows up the
controller asks the lookup for LONG_MATCH matching tokens (round_min_match). What an accepted token is worth depends on
whether requests wait for a row (token_values). A ledger of whole drafting rounds (RoundLedger:
seconds their accepted tokens saved minus their draft and extra verify seconds) turns drafting off
while it loses, probing at gaps that grow while the probes lose; from 3 rows up the first rounds
alternate with plain ones, so the verify cost is measured at no proposals. The cap depends on the
batch and the machine: greedy and coupled outputs cannot change (any proposal is verified), but
rejection-sampled outputs with a fixed seed would, so adaptive defaults to off there (their
distribution is exact either way).
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np



def proposal_lengths(confidence: np.ndarray, limit: np.ndarray, threshold: float, floor: float | None = None
                     ) -> np.ndarray:
    """p_i from the row's confidences at each draft step [R, S] and its limit [R] (the rule above,
    as one function; the engines apply it step by step and the checkers recompute it with this).
    floor None: floor = threshold."""
    confidence = np.asarray(confidence, dtype=float).reshape(len(limit), -1)
    passed = np.pad(confidence >= threshold, ((0, 0), (1, 0)), constant_values=True)[:, :-1]
    reached = passed.cumprod(axis=1).astype(bool)  # every step before j passed the threshold
    steps = np.arange(confidence.shape[1])[None, :] < np.asarray(limit)[:, None]
    proposes = reached & (confidence >= (threshold if floor is None else floor)) & steps
    return proposes.cumprod(axis=1).sum(axis=1)  # and proposed at every earlier step


class LinearCost:
    """seconds = a + b * x fitted through the median of the last `per_size` observations at each x
    (x: tokens or rows), weighted by how many there are. Medians, because one round slowed down by
    the machine must not move the fit: at batch 1 most verifies have one width, and a least-squares
    line through a few noisy wider ones once put one more verified token at 3-7 ms instead of 0.7."""

    def __init__(self, per_size: int = 16):
        self.samples: dict = {}
        self.per_size = per_size
        self.fit = None

    def add(self, x: float, seconds: float) -> None:
        self.samples.setdefault(float(x), deque(maxlen=self.per_size)).append(float(seconds))
        self.fit = None

    def measured(self) -> bool:
        return bool(self.samples)

    def ready(self) -> bool:
        return len(self.samples) >= 2

    def __call__(self, x: float) -> float:
        if self.fit is None:
            xs = np.array(list(self.samples))
            ys = np.array([np.median(v) for v in self.samples.values()])
            weight = np.array([len(v) for v in self.samples.values()], dtype=float)
            if len(xs) < 2:  # one size seen: proportional through that point
                self.fit = (0.0, float(ys[0] / xs[0]))
            else:
                b, a = np.polyfit(xs, ys, 1, w=np.sqrt(weight))
                b = max(float(b), 0.0)
                self.fit = (max(float(np.average(ys - b * xs, weights=weight)), 0.0), b)
        a, b = self.fit
        return a + b * x


class RowHistory:
    """A row's recent proposals, counted with exponential forgetting (DECAY per round it drafts)."""

    DECAY = 0.9

    def __init__(self):
        self.accepted = self.rejected = 0.0

    def add(self, proposed: int, accepted: int) -> None:
        self.accepted = self.accepted * self.DECAY + accepted
        self.rejected = self.rejected * self.DECAY + (accepted < proposed)

    def acceptance(self, prior: "RowHistory | None" = None, weight: float = 2.0) -> float:
        """P(accepted | proposed, earlier ones accepted), shrunk towards the prior's rate (the batch's
        pooled history) with `weight` pseudo-counts."""
        pa = prior.acceptance(None) if prior is not None else 0.5
        return (self.accepted + weight * pa) / (self.accepted + self.rejected + weight)


class DepthHistory:
    """Acceptance by draft depth, pooled over rows: runs of accepted drafts are not independent (a
    prompt-lookup match that held for one token tends to hold for the next), so the chance that the
    d-th proposal is accepted, given the earlier ones were, grows with d. `factors` scales a row's
    own rate to each depth."""

    DECAY = 0.98

    def __init__(self, k: int):
        self.reached = np.zeros(k)  # proposals at depth d whose earlier proposals were all accepted
        self.accepted = np.zeros(k)

    def add(self, proposed: int, accepted: int) -> None:
        self.reached *= self.DECAY
        self.accepted *= self.DECAY
        depth = np.arange(len(self.reached))
        self.reached += (depth < proposed) & (depth <= accepted)
        self.accepted += depth < min(accepted, proposed)

    def factors(self, weight: float = 2.0) -> np.ndarray:
        """Per depth: (pooled rate at depth d) / (pooled rate at depth 0), shrunk towards 1."""
        overall = (self.accepted.sum() + 1.0) / (self.reached.sum() + 2.0)
        rate = (self.accepted + weight * overall) / (self.reached + weight)
        return rate / rate[0] if len(rate) else rate


class StepYield:
    """What each draft step has bought, measured rather than forecast. Over the rounds that ran
    step s (0-based: it drafts the (s+1)-th token), pooled and decayed: rows whose limit allowed a
    proposal at s (eligible), proposals made at s (each costs a verify token) and proposals made at
    s that were accepted with all earlier ones (each saves a plain round's share). A row reaches a
    deep step only if its draft was confident at every earlier one, so these rates fold in what a
    per-step forecast misses: confident streaks, lookup matches that hold for several tokens."""

    DECAY = 0.99

    def __init__(self, k: int):
        self.eligible, self.proposed, self.accepted = np.zeros(k), np.zeros(k), np.zeros(k)

    def add(self, steps: int, limit, proposed, accepted) -> None:
        ran = np.arange(len(self.eligible)) < steps
        depth = np.arange(len(self.eligible))[:, None]
        limit, proposed = np.asarray(limit)[None, :], np.asarray(proposed)[None, :]
        landed = np.minimum(np.asarray(accepted)[None, :], proposed)
        for counts, now in ((self.eligible, (limit > depth).sum(axis=1)), (self.proposed, (proposed > depth).sum(axis=1)),
                            (self.accepted, (landed > depth).sum(axis=1))):
            counts[ran] = counts[ran] * self.DECAY + now[ran]

    def worth(self, step: int, values: np.ndarray, token_seconds: float, draft_step: float) -> bool:
        """Whether running step `step` for the rows that may draft there (`values`: the seconds an
        accepted token saves in each, DraftController.token_values) is expected to save more than
        it costs (False while it has not been measured: the controller's first rounds and its probes
        run it)."""
        if self.eligible[step] < 1:
            return False
        accepted, proposed = self.accepted[step] / self.eligible[step], self.proposed[step] / self.eligible[step]
        return accepted * float(np.sum(values)) - proposed * len(values) * token_seconds >= draft_step


class RoundLedger:
    """What drafting rounds have actually bought, net of what they cost, as a decayed mean over the
    rounds that drafted: saved = the accepted tokens times what each was worth in its row when the
    caps were chosen (DraftController.token_values), cost = the round's draft seconds plus its verify
    forward beyond a plain one of the same rows (the fitted verify cost). The forecasts behind the
    caps are per row and per step; this is the check on the whole round, with the costs no forecast
    sees (host copies, lookup, the draft's own bookkeeping). At batch 13 on Spec-Bench the caps'
    forecasts paid on paper while the rounds lost 10% to target-only decoding."""

    DECAY = 0.9
    MIN_ROUNDS = 8  # rounds measured before the ledger may stop drafting

    def __init__(self):
        self.net, self.rounds = 0.0, 0

    def add(self, saved: float, cost: float) -> None:
        self.net = self.net * self.DECAY + (saved - cost)
        self.rounds += 1

    def forget(self) -> None:
        """A round without drafting: what was measured before weighs less (the next probe decides)."""
        self.net *= self.DECAY

    def losing(self) -> bool:
        """Whether drafting rounds have lately cost more than they saved."""
        return self.rounds >= self.MIN_ROUNDS and self.net < 0


class DraftController:
    """Chooses each row's cap for the round from measured costs and the row's history.

    A row's j-th proposal pays when its chance to be accepted is worth the verify token it costs:
    P(j proposals all accepted) x (seconds an accepted token saves in that row: token_values, a
    plain round's share while requests wait, and only in the rows that finish last when none
    does) >= (marginal seconds of one more verified token). The round then drafts as
    many steps as some row's cap, dropping the last step while what that step has measurably bought
    in earlier rounds (StepYield, for as many rows as may still draft there) does not cover one
    draft step. (A forecast from per-step rates, P(propose)^d, dropped deep steps that paid: on
    Spec-Bench at batch 1 it ran 7% behind fixed k.) Probe rounds (every PROBE_EVERY) let each row
    propose at least one token, and every step up to a depth that cycles through 1..k run, so row
    histories and step yields keep being measured. While the ledger of whole drafting rounds
    (RoundLedger) says they lose, rounds of LEDGER_FROM_ROWS rows or more are plain target steps,
    except the ledger's probes, which draft by the caps above so the ledger keeps being measured:
    PROBE_EVERY rounds after it turned, then at gaps that double with each probe, up to PROBE_LIMIT
    (a probe is a drafting round, and at batch 13 on Spec-Bench the ledger stays negative through a
    whole run, where probes every 16 rounds were 7 of its 128). Plain rounds make the ledger forget
    (RoundLedger.forget), so a probe that pays resumes drafting; the gaps start over only once
    drafting has paid for PROBE_EVERY rounds, so one lucky probe and a few losing rounds after it do
    not bring the probes back to every 16 rounds."""

    PROBE_EVERY = 16
    # From this many rows up every round is shallow (row_caps): each row's cap is 1, its floor the
    # run's, its lookup match the draft's own min_match; no ledger, probes or step trimming. At 13 rows
    # a verify token that widens every row from one query to two costs 0.8-2.5 ms of a ~220 ms round, a
    # second draft step ~7 ms, and first draft tokens are accepted ~46% of the time; the controller's
    # per-row forecasts let only the rows that may finish last propose, and only above the threshold,
    # so the slowest rows hardly ever did; one token from every row beats that at 13 rows (compare with
    # benchmarks/controller_ab.py --variants ar,default,fixed-k1-t0-f0). At 8 rows, where requests
    # wait for most of the run, the two are even, so 8 rows keep the controller.
    SHALLOW_FROM_ROWS = 9
    # Draft steps are trimmed by their measured yield from this many rows up. Below it a verify token
    # costs about 1% of a round and a draft step about 10%, so the yields hover at break-even, and a
    # trimmed step is measured again only in probes: on Spec-Bench at batch 1 the trimming cost 6-13%
    # against the threshold alone (27.8-28.1 vs 24.7-26.1 tokens/s), while from batch 4 it gains.
    TRIM_FROM_ROWS = 3
    # The floor (a row proposes the token of the step that stops it) applies below this many rows: at
    # batch 1 a verify token costs ~1 ms of a ~45 ms round and the floor's tokens bought 3-5% (13
    # Spec-Bench prompts, 977 rounds against 1,027), while at batch 8 the same tokens, ~2.5 ms each,
    # cost 7% in four alternating pairs (0.95x against 1.02x target-only).
    FLOOR_BELOW_ROWS = 3
    # From this many rows up a prompt lookup proposes only where at least LONG_MATCH tokens match (the
    # lookup-first draft's own min_match, 2 by default, below): in Spec-Bench at batch 13 the head behind
    # lookup had 46% of its 2-token matches accepted (34% where the head disagreed) against 73% of
    # longer ones (benchmarks/lookup_acceptance.py), and the rows without a long match draft by the
    # feature head instead. At batch 1, where a verify token costs ~1 ms of a round, the 2-token matches
    # pay (0.93x and 0.97x without them), while batch 4 and 8 gained 3-6% (benchmarks/controller_ab.py
    # --variants default,short-lookup compares them).
    LONG_MATCH_FROM_ROWS = 3
    LONG_MATCH = 3
    # The round ledger stops drafting from this many rows up. Below it an accepted token is worth a
    # large share of a round, and the ledger's false alarms cost more than it saves: each fresh answer
    # opens with rounds whose proposals are mostly rejected, and `specbatch demo` (batch 2, short
    # answers) ran at 1.03x with the ledger there against 1.09x without (tau 1.10 against 1.22).
    LEDGER_FROM_ROWS = 3
    PROBE_LIMIT = 64  # the longest gap between the ledger's probes while drafting keeps losing
    # From LEDGER_FROM_ROWS rows up, every second round is plain until this many plain rounds have been
    # measured: the verify cost's line needs its point at no proposals. Fitted through drafting rounds
    # alone (13 to 34 tokens at batch 13, noisy), its slope came out at 0-1.4 ms a token instead of
    # about 2.2, the ledger saw no extra verify cost, and drafting ran on for 20-30 losing rounds.
    PLAIN_SAMPLES = 3

    def __init__(self, k: int, adaptive: bool):
        self.k, self.adaptive = k, adaptive
        self.verify_cost, self.draft_cost = LinearCost(), LinearCost()
        self.rows: dict = {}
        self.pooled = RowHistory()
        self.depths = DepthHistory(k)
        self.steps = StepYield(k)
        self.overhead: deque = deque(maxlen=64)  # seconds of a round outside draft and verify
        self.last_record = None
        self.rounds = 0
        self.caps: list = []  # the round's largest cap, per round (statistics)
        self.ledger = RoundLedger()
        self.values = None  # per row, what an accepted token saves (the round's caps were chosen with it)
        self.guarded_rounds = 0  # rounds made plain by the ledger (statistics)
        self.probe_gap = self.PROBE_EVERY  # rounds from the ledger's next probe to the one after it
        self.next_probe = self.PROBE_EVERY  # the round of the ledger's next probe, while it is losing
        self.plain_rounds = 0  # rounds measured without proposals
        self.paying_rounds = 0  # rounds since the ledger last said drafting loses

    def row_caps(self, requests, clamp: np.ndarray, remaining=None, waiting: bool = True):
        """(caps, lookup_caps): each row's cap this round for proposals that need draft model steps,
        and for proposals a lookup row makes by prompt lookup alone (engine.draft_round), which
        cost verify tokens but no draft step. clamp: the row's min(k, remaining - 1); remaining:
        the tokens left in each row's budget; waiting: whether requests wait for a row to finish."""
        self.rounds += 1
        self.values = None
        clamp = np.asarray(clamp, dtype=np.int64)
        if self.shallow(len(clamp)):  # one token from every row (the ledger records nothing: values None)
            caps = np.minimum(clamp, 1)
            self.caps.append(int(caps.max(initial=0)))
            return caps, caps
        guarded = len(clamp) >= self.LEDGER_FROM_ROWS and self.ledger.losing()  # the ledger stops drafting
        if not self.adaptive or self.k == 0 or not clamp.max():
            caps = lookup_caps = clamp
        elif len(clamp) >= self.LEDGER_FROM_ROWS and self.plain_rounds < self.PLAIN_SAMPLES and self.rounds % 2 == 0:
            caps = lookup_caps = np.zeros_like(clamp)  # a plain round: the verify cost at no proposals
        elif not self.draft_cost.measured() or not self.verify_cost.ready():
            caps = lookup_caps = clamp  # explore until a draft step and verifies of two widths have been measured
        elif guarded and self.rounds < self.next_probe:
            caps = lookup_caps = np.zeros_like(clamp)  # whole drafting rounds lose: a plain target step
            self.guarded_rounds += 1
            self.ledger.forget()
        else:
            caps, lookup_caps = self.best_caps([self.rows.get(int(r), RowHistory()) for r in requests], clamp,
                                               remaining, waiting)
            if guarded:  # the ledger's probe: the
                self.probe_gap = min(2 * self.probe_gap, self.PROBE_LIMIT)       # policy's own round
                self.next_probe = self.rounds + self.probe_gap
            elif self.rounds % self.PROBE_EVERY == 0:
                depth = 1 + (self.rounds // self.PROBE_EVERY) % self.k
                caps = np.maximum(caps, np.minimum(clamp, 1))
                deepest = int(np.argmax(clamp))  # one row drafts to the probe depth: every step there runs
                caps[deepest] = max(int(caps[deepest]), min(int(clamp[deepest]), depth))
                lookup_caps = np.maximum(lookup_caps, caps)
        if not self.ledger.losing():  # drafting pays (or is not yet judged)
            self.paying_rounds += 1
            if self.paying_rounds >= self.PROBE_EVERY:  # for a while: probes start over if it stops
                self.probe_gap = self.PROBE_EVERY
            self.next_probe = self.rounds + self.probe_gap
        else:
            self.paying_rounds = 0
        self.caps.append(int(caps.max()) if len(caps) else 0)
        return caps, lookup_caps

    def shallow(self, rows: int) -> bool:
        """Whether a round of `rows` rows is shallow (SHALLOW_FROM_ROWS): one token from every row."""
        return bool(self.adaptive and self.k and rows >= self.SHALLOW_FROM_ROWS)

    def round_floor(self, rows: int, floor: float, threshold: float) -> float:
        """The floor of a round of `rows` rows: the run's, or the threshold (no token below it is
        proposed) in adaptive rounds of FLOOR_BELOW_ROWS rows or more that are not shallow."""
        raised = self.adaptive and self.k and rows >= self.FLOOR_BELOW_ROWS and not self.shallow(rows)
        return threshold if raised else floor

    def round_min_match(self, rows: int, min_match: int) -> int:
        """The matching tokens a prompt lookup needs in a round of `rows` rows: the draft's own
        min_match, or LONG_MATCH in adaptive rounds of LONG_MATCH_FROM_ROWS rows or more that are
        not shallow."""
        long = self.adaptive and self.k and rows >= self.LONG_MATCH_FROM_ROWS and not self.shallow(rows)
        return max(min_match, self.LONG_MATCH) if long else min_match

    def best_caps(self, histories, clamp: np.ndarray, remaining=None, waiting: bool = True):
        """(caps, lookup_caps): lookup_caps are the caps whose proposals pay for their verify tokens;
        caps are those cut to the draft steps that pay for themselves."""
        rows = len(histories)
        overhead = float(np.median(self.overhead)) if self.overhead else 0.0
        token_seconds = self.verify_cost(rows + 1) - self.verify_cost(rows)  # one more verified token
        draft_step = self.draft_cost(rows)
        value = self.token_values(rows, overhead, remaining, waiting)
        self.values = value
        factors = self.depths.factors()
        a = np.array([h.acceptance(self.pooled) for h in histories]).reshape(rows)
        accept = np.cumprod(np.minimum(a[:, None] * factors[None, :], 0.98), axis=1)  # P(those d all accepted)
        pays = accept * value[:, None] >= token_seconds  # the d-th proposal is worth its verify token
        lookup_caps = np.minimum(np.asarray(clamp, dtype=np.int64), pays.cumprod(axis=1).sum(axis=1))
        caps, steps = lookup_caps, int(lookup_caps.max(initial=0))
        trim = rows >= self.TRIM_FROM_ROWS
        while trim and steps > 0 and not self.steps.worth(steps - 1, value[caps >= steps], token_seconds, draft_step):
            steps -= 1  # the last step does not pay for itself
            caps = np.minimum(caps, steps)
        return caps, lookup_caps

    def token_values(self, rows: int, overhead: float, remaining=None, waiting: bool = True) -> np.ndarray:
        """Seconds an accepted token saves, per row. A round of R rows costs verify(R) + overhead;
        verified tokens are the committed ones plus the rejected proposals, so an accepted token
        saves only by making rounds fewer. While requests wait (or no budgets are given), every
        slot-round yields a token, and a token saves its share of a round, (verify(R) +
        overhead) / R. With nobody waiting the batch runs until its last row finishes: only the
        rows that may finish last (the most tokens left, within one round's k) shorten it, so a
        token saves one round's cost shared among those m rows, and nothing elsewhere."""
        if waiting or remaining is None or rows < 2:
            return np.full(rows, max(self.verify_cost(rows) + overhead, 1e-9) / rows)
        remaining = np.asarray(remaining)
        last = remaining >= remaining.max() - self.k
        m = int(last.sum())
        return np.where(last, max(self.verify_cost(m) + overhead, 1e-9) / m, 0.0)

    def record(self, requests, proposed, accepted, reached_limit, rows: int, draft_steps: int, draft_seconds: float,
               verify_tokens: int, verify_seconds: float, limit, model_rows=None) -> None:
        """One round's outcome: per row its proposal length, accepted drafts and whether it stopped
        at its limit (True) or on its confidence (False), and its limit; the measured seconds;
        draft_steps: the draft model's steps; model_rows: the rows drafted by the model (None: all;
        the others were lookup rows, whose free proposals say nothing of what a model step buys)."""
        if draft_steps:
            self.draft_cost.add(rows, draft_seconds / draft_steps)
            use = slice(None) if model_rows is None else np.asarray(model_rows, dtype=bool)
            self.steps.add(draft_steps, np.asarray(limit)[use], np.asarray(proposed)[use], np.asarray(accepted)[use])
        self.verify_cost.add(verify_tokens, verify_seconds)
        self.plain_rounds += not np.any(proposed)
        if self.values is not None and np.any(proposed) and len(self.values) == len(proposed):
            landed = np.minimum(np.asarray(accepted), np.asarray(proposed))
            extra_verify = self.verify_cost(verify_tokens) - self.verify_cost(rows)
            self.ledger.add(float(np.dot(self.values, landed)), draft_seconds + max(extra_verify, 0.0))
        now = time.perf_counter()
        if self.last_record is not None:  # commit, bookkeeping, refills: paid once per round, saved by fewer rounds
            self.overhead.append(max(now - self.last_record - draft_seconds - verify_seconds, 0.0))
        self.last_record = now
        for r, p, acc, at_limit in zip(requests, proposed, accepted, reached_limit):
            if p or not at_limit:  # the row drafted (or was stopped by its confidence): evidence
                self.rows.setdefault(int(r), RowHistory()).add(int(p), int(acc))
                self.pooled.add(int(p), int(acc))
                self.depths.add(int(p), int(acc))

    def forget(self, request: int) -> None:
        self.rows.pop(int(request), None)
