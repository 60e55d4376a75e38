"""Variable per-row proposal lengths (fast.proposals): the rule, the controller, every strategy
against transformers' greedy decoding and the reference's rule under fuzzed confidences, traces
checked (I7), and mutants that let a row's length follow a neighbour or verify past its own
proposal caught."""
import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import specbatch
import specbatch.fast.engine as engine
from hf_models import EOS, VOCAB, oracle, tiny
from specbatch.fast.drafts import ScriptedDraft
from specbatch.fast.proposals import DraftController, LinearCost, RoundLedger, RowHistory, proposal_lengths
from specbatch.invariants import InvariantError, check_proposal_lengths, check_trace
from specbatch.reference import ToyLM, confidence_hashed, deviate_at, deviate_hashed
from specbatch.reference import generate as reference_generate
from specbatch.reference import rounds as reference_rounds

STRATEGIES = ["eqspec", "exspec", "ragged"]
RNG = np.random.default_rng(4)
PROMPTS = [RNG.integers(0, VOCAB, n).tolist() for n in (1, 9, 60, 3, 25, 2)]
PROMPTS[1][2] = EOS  # the pad id (== EOS) inside a prompt


@given(st.lists(st.lists(st.floats(0, 1), min_size=4, max_size=4), min_size=1, max_size=6),
       st.lists(st.integers(0, 4), min_size=6, max_size=6), st.floats(0, 1), st.floats(0, 1) | st.none())
def test_the_rule_three_ways(confidence, limits, threshold, floor_share):
    """fast.proposals, reference.rounds and the checker state the same rule: the leading steps at or
    above the threshold, then the step that stops the row if it is at or above the floor."""
    confidence = np.array(confidence)
    limit = np.array(limits[:len(confidence)])
    floor = None if floor_share is None else threshold * floor_share
    fast = proposal_lengths(confidence, limit, threshold, floor)
    assert (fast == reference_rounds.proposal_lengths(confidence, limit, threshold, floor)).all()
    assert check_proposal_lengths(fast, confidence, limit, threshold, floor) == []
    lowest = threshold if floor is None else floor
    for i in range(len(limit)):
        p = int(fast[i])
        assert p <= limit[i] and all(confidence[i, :max(p - 1, 0)] >= threshold)
        assert p == 0 or confidence[i, p - 1] >= lowest
        stopped = p > 0 and confidence[i, p - 1] < threshold
        assert p == limit[i] or stopped or confidence[i, p] < lowest
        if p < limit[i] and not stopped:  # the step that stopped the row was below the floor as well
            assert confidence[i, p] < lowest


def test_the_floor_proposes_the_step_that_stops_a_row():
    confidence = np.array([[0.9, 0.5, 0.9], [0.9, 0.1, 0.9], [0.3, 0.9, 0.9], [0.9, 0.9, 0.9]])
    limit = np.array([3, 3, 3, 2])
    assert list(proposal_lengths(confidence, limit, 0.7)) == [1, 1, 0, 2]
    assert list(proposal_lengths(confidence, limit, 0.7, 0.2)) == [2, 1, 1, 2]
    assert list(reference_rounds.proposal_lengths(confidence, limit, 0.7, 0.2)) == [2, 1, 1, 2]
    assert check_proposal_lengths([2, 1, 1, 2], confidence, limit, 0.7, 0.2) == []
    # the floor's token ends the row: nothing after it is proposed, however confident
    assert [v.row for v in check_proposal_lengths([3, 1, 1, 2], confidence, limit, 0.7, 0.2)] == [0]
    assert [v.row for v in check_proposal_lengths([1, 1, 1, 2], confidence, limit, 0.7, 0.2)] == [0]


def test_lookups_need_longer_matches_from_three_rows_up_with_the_controller_on():
    from specbatch.fast.proposals import DraftController
    on, off = DraftController(4, adaptive=True), DraftController(4, adaptive=False)
    assert [on.round_min_match(rows, 2) for rows in (1, 2, 3, 8, 9, 13)] == [2, 2, 3, 3, 2, 2]  # 9+: shallow
    assert [off.round_min_match(rows, 2) for rows in (1, 3, 13)] == [2, 2, 2]  # --fixed-k: the draft's own
    assert on.round_min_match(13, 4) == 4 and on.round_min_match(1, 1) == 1  # never below the draft's own
    assert DraftController(0, adaptive=True).round_min_match(13, 2) == 2  # k = 0 drafts nothing anyway


def test_from_nine_rows_up_every_row_may_propose_one_token_whatever_the_ledger_says():
    """Shallow rounds (DraftController.SHALLOW_FROM_ROWS): each row's cap is 1 (0 where its clamp is
    0), the floor is the run's and lookups need the draft's own match, even while the ledger says
    drafting loses; below it the controller's own rules hold."""
    c = ledger_controller(rows=9)
    c.ledger.net, c.ledger.rounds = -1.0, 99  # whole drafting rounds have been losing
    assert c.ledger.losing() and c.SHALLOW_FROM_ROWS == 9
    clamp = np.array([4, 4, 0, 1, 4, 3, 4, 4, 2, 4])
    caps, lookup_caps = c.row_caps(list(range(10)), clamp)
    assert list(caps) == list(lookup_caps) == [1, 1, 0, 1, 1, 1, 1, 1, 1, 1]
    assert list(c.row_caps(list(range(9)), clamp[:9])[0]) == [1, 1, 0, 1, 1, 1, 1, 1, 1]
    assert not c.row_caps(list(range(8)), clamp[:8])[0].any()  # 8 rows: the ledger's plain round
    assert [c.round_floor(rows, 0.2, 0.7) for rows in (1, 2, 3, 8, 9, 13)] == [0.2, 0.2, 0.7, 0.7, 0.2, 0.2]
    off = DraftController(4, adaptive=False)  # the documented way to fix k: no shallow rounds
    assert list(off.row_caps(list(range(10)), clamp)[0]) == list(clamp) and off.round_floor(13, 0.2, 0.7) == 0.2


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shallow_rounds_propose_one_token_per_row_above_the_floor(tmp_path, strategy):
    """Ten requests at once (nobody waits): every round of nine rows or more verifies at most one
    proposal per row, including tokens below the threshold and at or above the floor; the output is
    exact and the trace passes the checker (I7 with the traced limits and floor)."""
    target = tiny("llama")
    draft = ScriptedDraft(target, deviate_hashed(1, 0.3), confidence=confidence_hashed(5))
    rng = np.random.default_rng(13)  # its own prompts, whichever tests ran before
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (4, 11, 2, 7, 30, 5, 9, 3, 16, 6)]
    path = tmp_path / "t.jsonl"
    result = specbatch.generate(target, draft, prompts, max_new_tokens=10, num_draft_tokens=4, batch_size=10,
                                strategy=strategy, draft_threshold=0.5, trace=path)
    assert result.sequences == oracle(target, prompts, 10, [EOS])
    assert check_trace(path) == []
    rounds = [rnd["rows"] for rnd in map(json.loads, open(path)) if "round" in rnd]
    wide = [row for rows in rounds if len(rows) >= 9 for row in rows]
    assert wide and all(row["limit"] <= 1 and row["floor"] == 0.2 for row in wide)
    first = [row["draft_confidence"][0] for row in wide if row["draft_limit"]]
    assert any(0.2 <= c < 0.5 for c in first) and all(c >= 0.2 for c in first)  # the floor, not the threshold
    assert any(row["draft_limit"] == 0 and row["limit"] == 1 for row in wide)  # below the floor: no proposal


def test_a_length_that_follows_a_neighbour_breaks_the_rule():
    confidence = np.array([[0.9, 0.9, 0.1], [0.9, 0.1, 0.9]])
    limit = np.array([3, 3])
    good = proposal_lengths(confidence, limit, 0.5)
    assert list(good) == [2, 1]
    swapped = good[::-1]  # each row took the other's length
    assert [v.invariant for v in check_proposal_lengths(swapped, confidence, limit, 0.5)] == ["I7", "I7"]
    longest = np.full(2, good.max())  # every row verifies the round's longest proposal
    assert [v.row for v in check_proposal_lengths(longest, confidence, limit, 0.5)] == [1]


def test_linear_cost_fits_and_the_controller_prefers_cheap_likely_drafts():
    cost = LinearCost()
    for x in (1, 2, 5, 8):
        cost.add(x, 0.010 + 0.002 * x)
    assert cost(10) == pytest.approx(0.030)

    def controller(draft_step, per_token, accepted):
        c = DraftController(k=4, adaptive=True)
        for _ in range(3):
            c.draft_cost.add(4, draft_step)
        for tokens in (4, 8, 20):
            c.verify_cost.add(tokens, 0.050 + per_token * tokens)
        for _ in range(20):  # rounds of the four rows, each proposing its whole limit
            c.record([0, 1, 2, 3], [4] * 4, accepted, [True] * 4, 4, 4, 4 * draft_step, 20, 0.050 + per_token * 20,
                     limit=[4] * 4)
        return c.best_caps([c.rows[r] for r in range(4)], np.full(4, 4))[0]

    # cheap verify tokens and drafts, every proposal accepted: every row drafts its whole limit
    assert list(controller(0.001, 0.0005, [4, 4, 4, 4])) == [4, 4, 4, 4]
    # a draft step as dear as a target step and proposals always rejected: a plain target step
    assert list(controller(0.05, 0.01, [0, 0, 0, 0])) == [0, 0, 0, 0]
    # moderate costs: the rows whose proposals are accepted draft, the others do not
    caps = controller(0.002, 0.004, [4, 4, 0, 0])
    assert caps[0] > 0 and caps[1] > 0 and caps[2] == caps[3] == 0


def test_with_nobody_waiting_only_the_rows_that_finish_last_draft():
    """All requests running at once: the batch lasts as long as its last row, so a token accepted in
    a row far ahead saves nothing (verified tokens = committed + rejected) and such rows do not
    propose; the rows with the most tokens left share a round's cost."""
    c = DraftController(k=4, adaptive=True)
    for _ in range(3):
        c.draft_cost.add(4, 0.002)
    for tokens in (2, 4, 8):
        c.verify_cost.add(tokens, 0.040 + 0.003 * tokens)
    for _ in range(20):
        c.record([0, 1, 2, 3], [2] * 4, [1] * 4, [False] * 4, 4, 3, 0.006, 12, 0.076, limit=[4] * 4)
    c.overhead.clear()
    remaining = np.array([100, 97, 40, 10])
    values = c.token_values(4, 0.0, remaining, waiting=False)
    assert values[2] == values[3] == 0 and values[0] == values[1] == pytest.approx((0.040 + 0.003 * 2) / 2)
    assert np.allclose(c.token_values(4, 0.0, remaining, waiting=True), (0.040 + 0.003 * 4) / 4)
    histories = [c.rows[r] for r in range(4)]
    caps, _ = c.best_caps(histories, np.full(4, 4), remaining, waiting=False)
    assert caps[0] > 0 and caps[1] > 0 and caps[2] == caps[3] == 0
    assert (c.best_caps(histories, np.full(4, 4), remaining, waiting=True)[0] > 0).all()


def ledger_controller(rows: int = 4, extra_tokens=(0, 8)) -> DraftController:
    """A controller with measured costs (a draft step 1 ms, a verify 50 ms + 1 ms a token, at `rows`
    plus each of `extra_tokens`) and the per-step trimming and the first plain rounds switched off,
    so only the round ledger can stop drafting."""
    c = DraftController(k=4, adaptive=True)
    c.TRIM_FROM_ROWS, c.PLAIN_SAMPLES = 99, 0
    c.draft_cost.add(rows, 0.001)
    for extra in extra_tokens:
        c.verify_cost.add(rows + extra, 0.050 + 0.001 * (rows + extra))
    return c


def settle(c: DraftController, caps: np.ndarray, pays: bool) -> None:
    """Record a round of `caps` that paid (every proposal accepted, 1 ms of drafting) or lost (none
    accepted, 80 ms of drafting); the verify costs 50 ms + 1 ms a token."""
    rows = len(caps)
    c.record(list(range(rows)), caps, caps if pays else 0 * caps, caps >= 4, rows, int(caps.max()),
             0.001 if pays else 0.080, rows + int(caps.sum()), 0.050 + 0.001 * (rows + caps.sum()), limit=caps)


def test_drafting_stops_while_whole_rounds_lose_and_its_probes_keep_measuring():
    """The round ledger: drafting rounds whose accepted tokens saved less than their draft and extra
    verify seconds make the following rounds plain target steps, except probes, which draft by the
    caps: PROBE_EVERY rounds after drafting stopped, then at gaps that double while the probes lose,
    up to PROBE_LIMIT; rounds that pay leave the caps alone, and a ledger back in profit resumes.
    (The per-step trimming and the first plain rounds are switched off, so only the ledger can stop
    drafting.)"""
    def controller(draft_seconds, rows=4):
        c = ledger_controller(rows, (0, 4, 8))
        plans, requests = [], list(range(rows))
        for _ in range(16 * DraftController.PROBE_EVERY):
            caps, _ = c.row_caps(requests, np.full(rows, 4))
            plans.append(caps.copy())
            c.record(requests, caps, np.minimum(caps, 1), caps >= 4, rows, int(caps.max()),
                     draft_seconds if caps.any() else 0.0, rows + int(caps.sum()),
                     0.050 + 0.001 * (rows + caps.sum()), limit=caps)
        return c, plans

    # one of four proposals accepted in each row, each worth a quarter of a 54 ms round; 80 ms of
    # drafting a round
    losing, plans = controller(0.080)
    assert losing.ledger.losing() and losing.guarded_rounds > 0
    drafting = [i + 1 for i, caps in enumerate(plans) if caps.any()]
    stopped = next(r for r in range(1, len(plans) + 1) if not plans[r - 1].any())  # the first plain round
    probes = [r for r in drafting if r > stopped]
    assert np.diff([stopped - 1] + probes).tolist() == [16, 32, 64, 64, 64][:len(probes)]  # gaps double
    assert len(probes) == 5 and losing.guarded_rounds == len(plans) - len(drafting)
    # the same rounds with 1 ms of drafting: they pay, and every round drafts
    paying, plans = controller(0.001)
    assert not paying.ledger.losing() and paying.guarded_rounds == 0
    assert all(caps.any() for caps in plans)
    # a ledger back in profit drafts again
    losing.ledger.add(1.0, 0.0)
    assert not losing.ledger.losing()
    assert losing.row_caps([0, 1, 2, 3], np.full(4, 4))[0].any()
    # below LEDGER_FROM_ROWS rows a losing ledger does not stop drafting
    small, plans = controller(0.080, rows=2)
    assert small.ledger.losing() and small.guarded_rounds == 0 and all(caps.any() for caps in plans)


def test_a_probe_that_pays_resumes_drafting_and_plain_rounds_forget():
    """While drafting is off the ledger forgets, so a probe that pays ends the plain rounds."""
    rows = 4
    c = ledger_controller(rows)
    for round_index in range(1, 5 * DraftController.PROBE_EVERY + 1):
        caps, _ = c.row_caps(list(range(rows)), np.full(rows, 4))
        losing_stretch = DraftController.PROBE_EVERY < round_index <= 3 * DraftController.PROBE_EVERY
        settle(c, caps, pays=not losing_stretch)  # pay, lose, pay
    assert c.guarded_rounds > 0 and not c.ledger.losing()  # drafting resumed after a paying probe
    assert c.row_caps(list(range(rows)), np.full(rows, 4))[0].any()
    # each plain round of the ledger's own forgets a DECAY of what it measured before
    c.ledger.net, c.next_probe, guarded = -1.0, c.rounds + 11, c.guarded_rounds
    for _ in range(10):
        assert not c.row_caps(list(range(rows)), np.full(rows, 4))[0].any()
    assert c.guarded_rounds == guarded + 10 and c.ledger.net == pytest.approx(-RoundLedger.DECAY ** 10)


def test_one_paying_probe_does_not_bring_the_probes_back_to_every_16_rounds():
    """A probe that pays resumes drafting, but the gap to the next probe keeps growing unless
    drafting then pays for PROBE_EVERY rounds (here the rounds after the lucky probe lose again)."""
    rows = 4
    c = ledger_controller(rows)
    lucky, drafted = None, []
    for round_index in range(1, 161):
        caps, _ = c.row_caps(list(range(rows)), np.full(rows, 4))
        if caps.any():
            drafted.append(round_index)
            lucky = lucky or (round_index if c.guarded_rounds else None)  # the first probe pays
        settle(c, caps, pays=round_index == lucky)
    stretch_end = lucky  # the last round of the drafting that the lucky probe resumed
    while stretch_end + 1 in drafted:
        stretch_end += 1
    probes = [r for r in drafted if r > stretch_end]
    assert probes[:2] == [stretch_end + 32, stretch_end + 32 + 64]


def test_the_controller_measures_plain_rounds_first_from_three_rows_up():
    """From LEDGER_FROM_ROWS rows up (below SHALLOW_FROM_ROWS), every second round is plain until
    PLAIN_SAMPLES plain rounds are measured, so the verify cost's line has its point at no proposals
    (here a true cost of 50 ms + 2 ms a token, with noisy drafting rounds: the fitted slope is the
    true one)."""
    def run(rows, rounds=12):
        c = DraftController(k=4, adaptive=True)
        plans, requests, noise = [], list(range(rows)), np.random.default_rng(0)
        for _ in range(rounds):
            caps, _ = c.row_caps(requests, np.full(rows, 4))
            plans.append(caps.copy())
            tokens = rows + int(caps.sum())
            c.record(requests, caps, np.minimum(caps, 1), caps >= 4, rows, int(caps.max()), 0.002 if caps.any() else 0.0,
                     tokens, 0.050 + 0.002 * tokens + noise.normal(0, 0.004) * (tokens > rows), limit=caps)
        return c, [bool(caps.any()) for caps in plans]

    c, drafted = run(8)
    assert [i + 1 for i, d in enumerate(drafted) if not d][:DraftController.PLAIN_SAMPLES] == [2, 4, 6]
    assert c.plain_rounds >= DraftController.PLAIN_SAMPLES and all(drafted[6::2])
    assert c.verify_cost(9) - c.verify_cost(8) == pytest.approx(0.002, rel=0.5)
    c, drafted = run(2)  # below LEDGER_FROM_ROWS: no plain rounds are imposed
    assert all(drafted)


def test_the_ledger_counts_what_accepted_tokens_saved_against_draft_and_extra_verify_seconds():
    c = DraftController(k=4, adaptive=True)
    for tokens in (2, 10):
        c.verify_cost.add(tokens, 0.050 + 0.004 * tokens)
    c.values = np.array([0.030, 0.0, 0.020])  # what a token saves in each row (the middle row: nothing)
    c.record([0, 1, 2], [4, 4, 2], [1, 4, 5], [True, True, True], 3, 4, 0.010, 13, 0.102, limit=[4, 4, 2])
    saved = 0.030 * 1 + 0.0 * 4 + 0.020 * 2  # accepted, at most the row's proposals
    assert c.ledger.net == pytest.approx(saved - (0.010 + 0.004 * (13 - 3)))


def test_a_rows_acceptance_counts_a_rejection_only_when_a_proposal_was_turned_down():
    h = RowHistory()
    h.add(4, 4)  # all four accepted: no rejection
    assert h.acceptance() == pytest.approx((4 + 2 * 0.5) / (4 + 2))
    h.add(3, 1)  # the second of three turned down; the earlier counts forgotten by DECAY
    d = RowHistory.DECAY
    assert h.acceptance() == pytest.approx((4 * d + 1 + 1) / (4 * d + 1 + 1 + 2))


def test_draft_steps_run_as_far_as_their_measured_yield_pays():
    """The round's last draft step is dropped while what it bought in earlier rounds (StepYield)
    does not cover a draft step, whatever the per-proposal forecast says (three rows alike)."""
    draft_step, plain, token = 0.005, 0.010, 0.001

    def controller(rounds):
        c = DraftController(k=4, adaptive=True)
        for tokens in (3, 15):
            c.verify_cost.add(tokens, plain + (tokens - 3) * token)
        for _ in range(20):
            for proposed, accepted, steps in rounds:
                c.record([0, 1, 2], [proposed] * 3, [accepted] * 3, [proposed == 4] * 3, 3, steps, steps * draft_step,
                         3 * (1 + proposed), plain + 3 * proposed * token, limit=[4] * 3)
        c.overhead.clear()
        return c

    # a confident streak (a lookup match: 4 proposed, 4 accepted) or a stop at the first step: the deep
    # steps buy a plain round's share in each row each time they run, so all four run (a forecast from
    # the per-step proposal rate, 0.8^d, would drop steps 2..4)
    streaky = controller([(0, 0, 1), (4, 4, 4)])
    assert list(streaky.best_caps([streaky.rows[r] for r in range(3)], np.full(3, 4))[0]) == [4, 4, 4]
    # one proposal a round, accepted half the time: its verify token pays (0.5 x 3.3 ms > 1 ms) but the
    # step buys 2 ms net for 5 ms of drafting, so the round is a plain target step
    weak = controller([(1, 1, 2), (1, 0, 2)])
    assert weak.steps.worth(0, np.array([plain]), token, 0.003)  # a row worth a whole round: it would run
    assert weak.steps.worth(0, np.array([plain, plain]), token, draft_step)  # and for two such rows
    caps, lookup_caps = weak.best_caps([weak.rows[r] for r in range(3)], np.full(3, 4))
    assert list(caps) == [0, 0, 0]
    assert (lookup_caps > 0).all()  # a lookup row's proposals need no draft step: they only pay their verify
    # below TRIM_FROM_ROWS rows the threshold alone decides how far a row drafts
    assert list(weak.best_caps([weak.rows[0]] * 2, np.full(2, 4))[0]) == list(weak.best_caps(
        [weak.rows[0]] * 2, np.full(2, 4))[1])


@pytest.mark.parametrize("strategy", STRATEGIES)
@given(deviations=st.sets(st.integers(1, 90), max_size=30), k=st.integers(1, 6), batch=st.integers(1, 6),
       threshold=st.floats(0.05, 0.95), floor_share=st.floats(0, 1), seed=st.integers(0, 20),
       budgets=st.lists(st.integers(1, 12), min_size=6, max_size=6))
def test_fuzzed_confidences_every_strategy(tmp_path_factory, strategy, deviations, k, batch, threshold, floor_share,
                                          seed, budgets):
    """Scripted deviations and confidences: exact output, invariants (I7 included) every round, and
    every traced row's proposal length equal to the reference rule on its own confidences."""
    floor = threshold * floor_share
    target = tiny("llama")
    want = [s[:b] for s, b in zip(oracle(target, PROMPTS, 12, [EOS]), budgets)]
    draft = ScriptedDraft(target, deviate_at(deviations), confidence=confidence_hashed(seed))
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    result = specbatch.generate(target, draft, PROMPTS, max_new_tokens=budgets, num_draft_tokens=k,
                                batch_size=batch, strategy=strategy, draft_threshold=threshold,
                                draft_floor=floor, adaptive=False, check_invariants=True, trace=path)
    assert result.sequences == want
    assert check_trace(path) == []
    lines = [json.loads(x) for x in open(path)]
    for rnd in (x for x in lines if "round" in x):
        for row in rnd["rows"]:
            rule = reference_rounds.proposal_lengths([row["draft_confidence"]], [row["limit"]], threshold, floor)
            assert row["draft_limit"] == int(rule[0]) == len(row["drafted"])


def test_by_default_the_step_that_stops_a_row_proposes_above_the_floor(tmp_path):
    """draft_floor defaults to 0.2: traced rows propose the step that stopped them when its
    confidence is in [0.2, threshold), and not below 0.2."""
    target = tiny("llama")
    draft = ScriptedDraft(target, deviate_hashed(1, 0.1), confidence=confidence_hashed(5))
    path = tmp_path / "t.jsonl"
    result = specbatch.generate(target, draft, PROMPTS, max_new_tokens=12, num_draft_tokens=4, batch_size=3,
                                draft_threshold=0.5, adaptive=False, trace=path)
    assert result.sequences == oracle(target, PROMPTS, 12, [EOS])
    header, *lines = [json.loads(x) for x in open(path)]
    assert header["draft_floor"] == 0.2
    assert check_trace(path) == []
    last = [(row["draft_confidence"][row["draft_limit"] - 1]) for rnd in lines if "round" in rnd
            for row in rnd["rows"] if row["draft_limit"]]
    assert any(0.2 <= c < 0.5 for c in last) and all(c >= 0.2 for c in last)
    rows = [row for rnd in lines if "round" in rnd for row in rnd["rows"]]
    stopped = [row["draft_confidence"][row["draft_limit"]] for row in rows  # short of its limit, last proposal
               if row["draft_limit"] < min(row["limit"], len(row["draft_confidence"]))  # above the threshold
               and (row["draft_limit"] == 0 or row["draft_confidence"][row["draft_limit"] - 1] >= 0.5)]
    assert stopped and all(c < 0.2 for c in stopped)  # then the step that stopped it was below the floor


@pytest.mark.parametrize("batch, floor", [(1, 0.2), (2, 0.2), (3, 0.5), (6, 0.5)])
def test_the_controller_keeps_the_floor_below_three_rows(tmp_path, batch, floor):
    """Adaptive runs: rounds of FLOOR_BELOW_ROWS rows or more propose nothing below the threshold
    (the traced floor is the threshold there, and check_trace holds every row to it)."""
    target = tiny("llama")
    draft = ScriptedDraft(target, deviate_hashed(1, 0.1), confidence=confidence_hashed(5))
    path = tmp_path / "t.jsonl"
    prompts = PROMPTS[:batch]
    result = specbatch.generate(target, draft, prompts, max_new_tokens=8, num_draft_tokens=4, batch_size=batch,
                                draft_threshold=0.5, trace=path)
    assert result.sequences == oracle(target, prompts, 8, [EOS])
    assert check_trace(path) == []
    rows = [(len(rnd["rows"]), row) for rnd in map(json.loads, open(path)) if "round" in rnd for row in rnd["rows"]]
    assert {row["floor"] for n, row in rows if n == batch} == {floor}
    if floor == 0.5:
        assert all(row["draft_confidence"][p - 1] >= 0.5 for n, row in rows if n >= 3 and (p := row["draft_limit"]))


def test_the_checker_holds_a_row_to_a_floor_within_the_run_s(tmp_path):
    target = tiny("llama")
    draft = ScriptedDraft(target, deviate_hashed(1, 0.1), confidence=confidence_hashed(5))
    path = tmp_path / "t.jsonl"
    specbatch.generate(target, draft, PROMPTS[:2], max_new_tokens=8, num_draft_tokens=4, batch_size=2,
                       draft_threshold=0.5, trace=path)
    lines = open(path).read().splitlines()
    header = json.loads(lines[0])
    header["draft_floor"] = 0.3  # the rows say 0.2: below the run's floor
    (tmp_path / "low.jsonl").write_text("\n".join([json.dumps(header)] + lines[1:]) + "\n")
    assert {v.message for v in check_trace(tmp_path / "low.jsonl")} >= {
        "the row's floor is not between the run's draft_floor and draft_threshold"}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rows_stop_at_different_steps(strategy):
    """The scripted confidences really give rows of one round different proposal lengths, and the
    flat verify (ragged) processes only the proposals."""
    target = tiny("llama")
    draft = ScriptedDraft(target, deviate_hashed(1, 0.1), confidence=confidence_hashed(5))
    lengths = []

    def spy(*args, **kwargs):
        proposals = draft_round(*args, **kwargs)
        lengths.append(list(proposals.proposed))
        return proposals
    draft_round = engine.draft_round
    module = {"eqspec": "eqspec", "exspec": "eqspec", "ragged": "ragged"}[strategy]
    import importlib
    mod = importlib.import_module(f"specbatch.fast.strategies.{module}")
    original = mod.draft_round
    mod.draft_round = spy
    try:
        result = specbatch.generate(target, draft, PROMPTS, max_new_tokens=12, num_draft_tokens=4, batch_size=6,
                                    strategy=strategy, draft_threshold=0.5, adaptive=False)
    finally:
        mod.draft_round = original
    assert result.sequences == oracle(target, PROMPTS, 12, [EOS])
    assert any(len(set(r)) > 1 for r in lengths if len(r) > 1)
    assert result.stats["drafted_tokens"] == sum(sum(r) for r in lengths)


def test_the_default_controller_is_exact_and_plain_steps_happen():
    target = tiny("llama")
    draft = ScriptedDraft(target, deviate_hashed(2, 0.6), confidence=confidence_hashed(1, 0.5, 0.99))
    result = specbatch.generate(target, draft, PROMPTS, max_new_tokens=12, num_draft_tokens=4, batch_size=6,
                                strategy="ragged", check_invariants=True)
    assert result.sequences == oracle(target, PROMPTS, 12, [EOS])
    assert result.stats["rounds"] >= 12 / 5


def neighbour_rule(monkeypatch):
    """Mutant: a row's proposal length follows the next row's confidences."""
    original = engine.draft_round

    def draft_round(*args, **kwargs):
        proposals = original(*args, **kwargs)
        proposals.proposed = np.roll(proposals.proposed, 1) if len(proposals.proposed) > 1 else proposals.proposed
        proposals.proposed = np.minimum(proposals.proposed, proposals.steps)
        return proposals
    for name in ("eqspec", "ragged"):
        monkeypatch.setattr(f"specbatch.fast.strategies.{name}.draft_round", draft_round)


def verify_past_proposal(monkeypatch):
    """Mutant: the verify lets a row accept past its own proposal (up to the round's longest)."""
    from specbatch.fast import sampling
    from specbatch.fast.verify import greedy_accept

    def verify(self, logits, drafted, q, limit, requests, first_position):
        choice = logits.argmax(dim=-1)
        return choice, greedy_accept(drafted, choice, torch.full_like(limit, drafted.shape[1]))

    def verify_flat(self, logits, layout, drafted, q, limit, requests, first_position):
        choice = logits.argmax(dim=-1)[layout]
        return choice, greedy_accept(drafted, choice, torch.full_like(limit, drafted.shape[1]))
    monkeypatch.setattr(sampling.Greedy, "verify", verify)
    monkeypatch.setattr(sampling.Greedy, "verify_flat", verify_flat)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mutant", [neighbour_rule, verify_past_proposal])
def test_mutants_of_the_proposal_rule_are_caught(monkeypatch, tmp_path, strategy, mutant):
    target = tiny("llama")
    draft = ScriptedDraft(target, deviate_hashed(1, 0.1), confidence=confidence_hashed(5))
    kwargs = dict(max_new_tokens=12, num_draft_tokens=4, batch_size=6, strategy=strategy, draft_threshold=0.5,
                  adaptive=False)
    mutant(monkeypatch)
    expected = "I7" if mutant is neighbour_rule else "I5"
    with pytest.raises(InvariantError) as caught:
        specbatch.generate(target, draft, PROMPTS, check_invariants=True, **kwargs)
    assert caught.value.violations[0].invariant == expected
    path = tmp_path / "t.jsonl"
    specbatch.generate(target, draft, PROMPTS, trace=path, **kwargs)
    assert any(v.invariant == expected for v in check_trace(path))


@pytest.mark.parametrize("strategy", ["eqspec", "exspec", "ragged"])
def test_reference_with_scripted_confidences_equals_greedy(strategy):
    """The NumPy reference applies the same rule and stays exact (its own toy LM)."""
    target = ToyLM(vocab_size=VOCAB, dim=16, n_layers=2, seed=1)
    from specbatch.reference import ScriptedDraft as RefScripted, greedy_decode
    prompts = [RNG.integers(0, VOCAB, n).tolist() for n in (1, 7, 19, 4)]
    want = [greedy_decode(target, p, 10, (EOS,)) for p in prompts]
    draft = RefScripted(target, deviate_hashed(3, 0.2), confidence=confidence_hashed(2))
    result = reference_generate(target, draft, prompts, max_new_tokens=10, k=4, eos_ids=(EOS,), strategy=strategy,
                                batch_size=3, check=True, threshold=0.5)
    assert result.sequences == want
    fixed = reference_generate(target, draft, prompts, max_new_tokens=10, k=4, eos_ids=(EOS,), strategy=strategy,
                               batch_size=3)
    assert fixed.sequences == want and result.stats["drafted_tokens"] < fixed.stats["drafted_tokens"]
    floored = reference_generate(target, draft, prompts, max_new_tokens=10, k=4, eos_ids=(EOS,), strategy=strategy,
                                 batch_size=3, check=True, threshold=0.5, floor=0.2)
    assert floored.sequences == want
    assert result.stats["drafted_tokens"] < floored.stats["drafted_tokens"] < fixed.stats["drafted_tokens"]
