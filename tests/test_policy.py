"""Proposal policies (fast.policy): the goodput rule three ways, the round's best ratio against
every plan, the cost model's fits, what a token is worth, each row's estimates from its own history,
and the same code drafting deep where verify tokens are cheap and shallow where they are not."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specbatch.fast.costs import History, LinearCost
from specbatch.fast.policy import (FixedK, Goodput, PolicySettings, RoundInfo, RoundOutcome, Threshold, best_ratio,
                                   make_policy)
from specbatch.fast.proposals import GoodputRule, ThresholdRule, goodput_lengths
from specbatch.invariants import check_goodput_leaves, check_goodput_lengths, check_threshold_leaves

probability = st.floats(0, 1)


@given(st.lists(st.lists(probability, min_size=4, max_size=4), min_size=1, max_size=5),
       st.lists(st.integers(0, 4), min_size=5, max_size=5), st.lists(st.floats(0.05, 1), min_size=5, max_size=5),
       st.lists(st.floats(0.2, 2), min_size=5, max_size=5), st.floats(0, 1))
def test_the_goodput_rule_three_ways(confidence, limits, worth, calibration, bar):
    """Step by step as the engine applies it, on the whole round, and in the checker: the same lengths."""
    confidence = np.array(confidence)
    rows = len(confidence)
    limit, worth, calibration = np.array(limits[:rows]), np.array(worth[:rows]), np.array(calibration[:rows])
    rule = GoodputRule(limit, worth, calibration, np.full(rows, 0.5), bar, 0.0)
    active, proposed = rule.begin(np.ones(rows, dtype=bool)), np.zeros(rows, dtype=np.int64)
    for j in range(confidence.shape[1]):
        proposes, active = rule.step(j, confidence[:, j], active)
        proposed += proposes
    assert (proposed == goodput_lengths(confidence, limit, worth, calibration, bar)).all()
    assert check_goodput_lengths(proposed, confidence, limit, worth, calibration, bar) == []
    for i in range(rows):  # each proposal's expected worth pays for its verify token; the next one's does not
        p = int(proposed[i])
        value = worth[i] * np.cumprod(np.minimum(calibration[i] * confidence[i], 1.0))
        assert p <= limit[i] and all(value[:p] >= bar)
        assert p == limit[i] or value[p] < bar


def test_a_goodput_length_that_follows_a_neighbour_breaks_the_rule():
    confidence = np.array([[0.9, 0.9, 0.9], [0.9, 0.2, 0.9]])
    limit, worth, calibration = np.array([3, 3]), np.ones(2), np.ones(2)
    good = goodput_lengths(confidence, limit, worth, calibration, 0.5)
    assert list(good) == [3, 1]
    assert [v.row for v in check_goodput_lengths(good[::-1], confidence, limit, worth, calibration, 0.5)] == [0, 1]
    # each row's own calibration: swapped between the rows, the lengths change
    assert list(goodput_lengths(confidence, limit, worth, np.array([1, 0.3]), 0.5)) == [3, 0]
    assert list(goodput_lengths(confidence, limit, worth, np.array([0.3, 1]), 0.5)) == [0, 1]


def test_one_more_step_runs_only_while_the_model_rows_next_proposals_pay_for_it():
    confidence = np.full((2, 4), 0.9)
    rule = GoodputRule(np.array([4, 4]), np.ones(2), np.ones(2), np.full(2, 0.9), 0.1, 1.5)
    active = rule.begin(np.ones(2, dtype=bool))
    assert active.all()  # two rows' first proposals, each expected 0.9 - 0.1, pay for a step at 1.5
    proposes, active = rule.step(0, confidence[:, 0], active)
    assert proposes.all() and not active.any()  # the next ones (0.81 - 0.1 each) do not
    assert list(rule.limit) == [1, 1]  # the limit the checkers see
    lookup = GoodputRule(np.array([4, 4]), np.ones(2), np.ones(2), np.full(2, 0.9), 0.1, 1.5)
    active = lookup.begin(np.array([True, False]))  # row 1 drafts by lookup: no model step to pay for
    assert list(active) == [False, True] and list(lookup.limit) == [0, 4]
    for j in range(4):
        proposes, active = lookup.step(j, confidence[:, j], active)
    assert list(lookup.limit) == [0, 4]


def brute_ratio(worth, forecast, clamp, base, token, step):
    """Every plan p (0 <= p_i <= clamp_i): (worth committed) / (seconds)."""
    best = 0.0
    for plan in itertools.product(*[range(c + 1) for c in clamp]):
        committed = sum(w * (1 + sum(f ** j for j in range(1, p + 1))) for w, f, p in zip(worth, forecast, plan))
        best = max(best, committed / (base + step * max(plan) + token * sum(plan)))
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 1), st.floats(0, 0.99), st.integers(0, 3)), min_size=1, max_size=4),
       st.floats(0.01, 1), st.floats(0, 0.5), st.floats(0, 0.5))
def test_the_rounds_best_ratio_is_the_best_plan(rows, base, token, step):
    worth, forecast, clamp = (np.array(x) for x in zip(*rows))
    want = brute_ratio(worth, forecast, clamp, base, token, step)
    assert best_ratio(worth, forecast, clamp, base, token, step) == pytest.approx(want, rel=1e-9)


def test_linear_cost_fits_a_line_and_ignores_one_slow_round():
    cost = LinearCost()
    assert not cost.measured()
    cost.add(4, 0.02)
    assert cost(2) == pytest.approx(0.01)  # one size: through the origin
    cost = LinearCost()
    for x in (1, 2, 5, 8):
        for _ in range(3):
            cost.add(x, 0.010 + 0.002 * x)
    cost.add(8, 5.0)  # one round slowed down by the machine
    assert cost.slope() == pytest.approx(0.002, rel=1e-6) and cost(10) == pytest.approx(0.030, rel=1e-6)


def test_a_token_is_worth_one_while_requests_wait_and_its_share_of_the_longest_budget_otherwise():
    policy = Goodput(4)
    clamp = np.full(3, 4)
    remaining = np.array([40, 10, 20])
    assert list(policy.worth(RoundInfo(np.arange(3), clamp, remaining, waiting=True))) == [1, 1, 1]
    assert list(policy.worth(RoundInfo(np.arange(3), clamp, remaining, waiting=False))) == [1, 0.25, 0.5]
    assert list(policy.worth(RoundInfo(np.arange(3), clamp, None, waiting=False))) == [1, 1, 1]


def outcome(requests, proposed, accepted, confidence, steps=4, draft=0.01, tokens=None, verify=0.05, lookup_rows=None):
    proposed, accepted = np.asarray(proposed), np.asarray(accepted)
    return RoundOutcome(np.asarray(requests), proposed, accepted, np.asarray(confidence, dtype=float), steps, draft,
                        int(tokens if tokens is not None else len(proposed) + proposed.sum()), verify,
                        None if lookup_rows is None else np.asarray(lookup_rows))


def test_each_rows_estimates_come_from_its_own_history():
    policy = Goodput(4)
    for _ in range(5):  # request 7 has its proposals accepted, request 3 has them rejected
        policy.record(outcome([7, 3], [4, 4], [4, 0], np.full((2, 4), 0.8)))
    forecast, calibration = policy.estimates(np.array([7, 3]))
    assert forecast[0] > 0.8 > 0.3 > forecast[1] and calibration[0] > 1.0 > 0.4 > calibration[1]
    swapped = policy.estimates(np.array([3, 7]))
    assert list(swapped[0]) == list(forecast[::-1]) and list(swapped[1]) == list(calibration[::-1])
    fresh, _ = policy.estimates(np.array([99]))  # no history of its own: the batch's
    assert forecast[1] < fresh[0] < forecast[0]


def test_a_proposal_is_reached_only_when_every_earlier_one_was_accepted():
    policy = Goodput(4)
    policy.record(outcome([0], [4], [1], [[0.9, 0.8, 0.7, 0.6]]))
    h = policy.rows[0, False]
    assert (h.reached, h.accepted, h.confidence) == (2, 1, pytest.approx(1.7))
    policy.record(outcome([0], [0], [0], np.zeros((1, 0)), steps=0))  # evidence ages a round at a time
    assert (h.reached, h.accepted) == (2 * History.DECAY, History.DECAY)


def test_lookup_rows_have_their_own_calibration():
    """A lookup row's proposals have confidence 1 whatever their chance: their history is kept apart
    from the draft model's, and the rule takes the lookup one for the rows that draft by lookup."""
    policy = Goodput(4)
    for _ in range(5):  # request 0: model proposals accepted (round 1 of 2), lookup proposals rejected
        policy.record(outcome([0], [2], [2], [[0.6, 0.6]]))
        policy.record(outcome([0], [2], [0], [[1.0, 1.0]], steps=0, lookup_rows=[True]))
    model, lookup = policy.estimates([0])[1][0], policy.estimates([0], lookup=True)[1][0]
    assert model > 1.0 > 0.5 > lookup
    rule = policy.plan(RoundInfo(np.array([0, 0]), np.array([4, 4])))
    rule.begin(np.array([True, False]))  # row 1 drafts by lookup
    assert list(rule.calibration) == [model, lookup] and rule.fields(1)["calibration"] == lookup


def measured_policy(token_seconds: float, rows: int, step_seconds: float = 0.001) -> Goodput:
    """A goodput policy whose verify costs 0.04 s plus token_seconds a token, a draft step
    step_seconds, and whose rows have had 3 of every 4 proposals accepted at confidence 0.8."""
    policy = Goodput(4)
    for n in (rows, rows + 1, 2 * rows, 5 * rows):
        for _ in range(3):
            policy.verify_cost.add(n, 0.04 + token_seconds * n)
    policy.draft_cost.add(rows, step_seconds)
    for _ in range(10):
        policy.record(outcome(np.arange(rows), np.full(rows, 4), np.full(rows, 3), np.full((rows, 4), 0.8), steps=4,
                              draft=4 * step_seconds, tokens=5 * rows, verify=0.04 + token_seconds * 5 * rows))
    return policy


def lengths(policy: Goodput, rows: int, confidence: float = 0.9) -> np.ndarray:
    rule = policy.plan(RoundInfo(np.arange(rows), np.full(rows, 4), np.full(rows, 50), waiting=True))
    active, proposed = rule.begin(np.ones(rows, dtype=bool)), np.zeros(rows, dtype=np.int64)
    for j in range(4):
        proposes, active = rule.step(j, np.full(rows, confidence), active)
        proposed += proposes
    return proposed


@pytest.mark.parametrize("rows", [1, 13])
def test_the_same_policy_drafts_deep_where_verify_tokens_are_cheap_and_shallow_where_they_are_not(rows):
    """No row count decides: at any batch size, cheap verify tokens (a GPU, or one row on a CPU) give
    deep proposals; verify tokens that cost as much as a row's share of a round give fewer, and none
    where a round of many rows costs far more than one row's."""
    cheap = lengths(measured_policy(0.0001, rows), rows)
    dear = lengths(measured_policy(0.04, rows), rows)
    assert (cheap == 4).all() and (dear < cheap).all() and (rows == 1 or (dear == 0).all())
    assert (lengths(measured_policy(0.0001, rows), rows, confidence=0.001) == 0).all()  # unlikely drafts: none


def test_evidence_ages_so_drafting_resumes_after_a_losing_stretch():
    """Rows whose proposals were all rejected stop drafting; with no new evidence their history
    decays towards the prior and the first model step pays again: a probe no constant schedules."""
    policy = measured_policy(0.002, 4, step_seconds=0.005)
    for _ in range(100):
        policy.record(outcome(np.arange(4), np.full(4, 4), np.zeros(4, dtype=int), np.full((4, 4), 0.9),
                              draft=0.02, verify=0.04 + 0.002 * 20))
    plain = 0
    for _ in range(200):
        rule = policy.plan(RoundInfo(np.arange(4), np.full(4, 4), None, waiting=True))
        if rule.begin(np.ones(4, dtype=bool)).any():
            break
        plain += 1
        policy.record(outcome(np.arange(4), np.zeros(4, dtype=int), np.zeros(4, dtype=int), np.zeros((4, 0)),
                              steps=0, tokens=4, verify=0.04 + 0.002 * 4))
    assert 10 <= plain < 200


def test_make_policy_names_each_policy_and_refuses_others():
    assert make_policy(PolicySettings("goodput", 0)) is None
    assert isinstance(make_policy(PolicySettings("goodput", 4)), Goodput)
    fixed, threshold = make_policy(PolicySettings("fixed", 4)), make_policy(PolicySettings("threshold", 4, 0.6, 0.1))
    assert type(fixed) is FixedK and not fixed.reads_confidence
    assert isinstance(threshold, Threshold) and threshold.reads_confidence and threshold.plan(
        RoundInfo(np.arange(2), np.array([4, 2]))).limit.tolist() == [4, 2]
    with pytest.raises(ValueError, match="unknown proposal policy 'smart'"):
        make_policy(PolicySettings("smart", 4))


def test_linear_cost_never_prices_below_zero():
    """Measurements that fit a line with a negative intercept or a falling slope (noise, warm-up)
    give the best line with neither below zero: through the origin, or flat."""
    rising = LinearCost()  # the fitted line 0.011 x - 0.01 would cost less than nothing below x = 1
    for x, seconds in ((1, 0.001), (10, 0.1)):
        rising.add(x, seconds)
    best = (1 * 0.001 + 10 * 0.1) / (1 + 100)  # least squares through the origin
    assert rising.slope() == pytest.approx(best) and rising(0) == 0.0 and rising(10) == pytest.approx(10 * best)
    falling = LinearCost()  # the larger size measured faster: the cost does not shrink with the size
    for x, seconds in ((1, 0.05), (8, 0.01)):
        falling.add(x, seconds)
    assert falling.slope() == 0.0 and falling(100) == pytest.approx(0.03) and falling(0) == pytest.approx(0.03)


def test_two_nearby_sizes_do_not_price_the_others_far_too_high():
    """A draft step measured at 13 rows, then once at 12 a little faster: the line through the two
    is steep and far below zero at the origin. Clipping its intercept at zero without refitting
    priced 12 rows at 25 ms (four times what was measured), and the policy stopped drafting for
    the rest of the run; the constrained fit stays among the measurements."""
    cost = LinearCost()
    for _ in range(8):
        cost.add(13, 0.0065)
    cost.add(12, 0.0044)
    assert 0.0044 <= cost(12) <= 0.0065 and 0.0044 <= cost(13) <= 0.0066 and cost(0) == 0.0


def grow_tree(rule, confidence, runner_ups, model_rows=None, available=None):
    """Apply a rule step by step as engine.draft_round does: (proposed [R], leaves [R, S]); available
    [R, S]: the candidates each step has (None: all b - 1 on model rows, none on lookup rows)."""
    rows, steps = confidence.shape
    model_rows = np.ones(rows, dtype=bool) if model_rows is None else np.asarray(model_rows)
    if available is None:
        available = np.where(model_rows[:, None], runner_ups.shape[2], np.zeros((rows, steps), dtype=int))
    active, proposed, leaves = rule.begin(model_rows), np.zeros(rows, dtype=np.int64), []
    for j in range(steps):
        proposes, active = rule.step(j, confidence[:, j], active)
        proposed += proposes
        leaves.append(rule.leaves(j, runner_ups[:, j], proposes, available[:, j]))
    return proposed, np.stack(leaves, axis=1)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.floats(0.05, 1), st.floats(0.2, 3), st.floats(0, 0.8), st.data())
def test_the_goodput_leaves_three_ways(rows, most, worth, leaf_calibration, bar, data):
    """Leaf by leaf as the engine applies the rule, in the checker, and from the rule's statement:
    under each proposal, the leading runner-ups whose expected worth (reach before the step times
    the leaf's own acceptance, at the calibration of its source) pays for one verify token, of the
    candidates the step has (a lookup row's: the other followers its lookup found); none past the
    proposals."""
    confidence = np.array(data.draw(st.lists(st.lists(probability, min_size=3, max_size=3), min_size=rows,
                                             max_size=rows)))
    runner_ups = -np.sort(-np.array(data.draw(st.lists(st.lists(st.lists(st.floats(0, 0.5), min_size=most,
                                                                         max_size=most), min_size=3, max_size=3),
                                                       min_size=rows, max_size=rows))), axis=2)
    model_rows = np.array(data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows)))
    found = np.array(data.draw(st.lists(st.lists(st.integers(0, most), min_size=3, max_size=3), min_size=rows,
                                        max_size=rows)))
    available = np.where(model_rows[:, None], most, found)
    limit, worths, calibration = np.full(rows, 3), np.full(rows, worth), np.full(rows, 1.2)
    leaf_cal, lookup_leaf_cal = np.full(rows, leaf_calibration), np.full(rows, 0.7)
    rule = GoodputRule(limit, worths, calibration, np.full(rows, 0.5), bar, 0.0, calibration, leaf_cal,
                       lookup_leaf_cal)
    proposed, leaves = grow_tree(rule, confidence, runner_ups, model_rows, available)
    own_leaf_cal = np.where(model_rows, leaf_cal, lookup_leaf_cal)
    assert check_goodput_leaves(leaves, runner_ups, confidence, proposed, available, worths, calibration,
                                own_leaf_cal, bar) == []
    for i in range(rows):
        for j in range(3):
            reach = worth * np.prod(np.minimum(1.2 * confidence[i, :j], 1.0))
            value = reach * np.minimum(own_leaf_cal[i] * runner_ups[i, j], 1.0)
            want = min(int(np.cumprod(value >= bar).sum()), available[i, j]) if j < proposed[i] else 0
            assert leaves[i, j] == want


def test_the_leaf_checkers_name_a_wrong_count():
    confidence, runner_ups = np.array([[0.9, 0.9]]), np.array([[[0.3, 0.05], [0.3, 0.05]]])
    rule = GoodputRule(np.array([2]), np.ones(1), np.ones(1), np.ones(1), 0.2, 0.0)
    proposed, leaves = grow_tree(rule, confidence, runner_ups)
    assert proposed.tolist() == [2] and leaves.tolist() == [[1, 1]]  # 0.3 and 0.9 * 0.3 pay at 0.2; 0.05 does not
    args = (runner_ups, confidence, proposed, np.full((1, 2), 2), np.ones(1), np.ones(1), np.ones(1), 0.2)
    assert check_goodput_leaves(leaves, *args) == []
    bad = check_goodput_leaves(np.array([[1, 2]]), *args)
    assert [(v.row, v.index, v.expected, v.actual) for v in bad] == [(0, 1, 1, 2)]
    # the leaves of step 1 are reached only if step 0's proposal is accepted: priced by that reach
    shallow = GoodputRule(np.array([2]), np.ones(1), np.ones(1), np.ones(1), 0.25, 0.0)
    assert grow_tree(shallow, np.array([[0.8, 0.9]]), runner_ups)[1].tolist() == [[1, 0]]
    threshold = ThresholdRule(np.array([2, 2]))
    proposed, leaves = grow_tree(threshold, np.ones((2, 2)), np.zeros((2, 2, 2)), [True, False])
    assert leaves.tolist() == [[2, 2], [0, 0]]  # every leaf of a model row; this lookup row found no others
    available = np.array([[2, 2], [0, 0]])
    assert check_threshold_leaves(leaves, proposed, available) == []
    assert [v.row for v in check_threshold_leaves(leaves[::-1], proposed, available)] == [0, 0, 1, 1]
    # a lookup row whose lookup found one other follower at step 1 takes it
    assert grow_tree(threshold, np.ones((2, 2)), np.zeros((2, 2, 2)), [True, False],
                     np.array([[2, 2], [0, 1]]))[1].tolist() == [[2, 2], [0, 1]]
    assert [(v.row, v.index) for v in check_threshold_leaves(leaves, proposed, np.array([[2, 2], [0, 1]]))] == [(1, 1)]
    # the goodput rule never brings more leaves than the step has, even where more would pay
    free = GoodputRule(np.array([2]), np.ones(1), np.ones(1), np.ones(1), 0.0, 0.0)
    assert grow_tree(free, confidence, runner_ups, [False], np.array([[1, 0]]))[1].tolist() == [[1, 0]]


def test_a_leaf_is_priced_at_one_verify_token_so_dear_tokens_make_chains():
    """The same policy gives wide trees where verify tokens are cheap and chains where they are dear
    (no tree shape is fixed): a leaf pays like a proposal, by its expected worth against the bar."""
    rows = 4
    runner_ups = np.tile([0.2, 0.1], (rows, 4, 1))

    def tree(token_seconds):
        rule = measured_policy(token_seconds, rows).plan(RoundInfo(np.arange(rows), np.full(rows, 4), None))
        return grow_tree(rule, np.full((rows, 4), 0.8), runner_ups)
    cheap, dear = tree(0.0001), tree(0.01)
    assert (cheap[1][:, 0] == 2).all() and (cheap[1].sum(axis=1) > dear[1].sum(axis=1)).all()
    assert (dear[0] > 0).all() and (dear[1] == 0).all()  # proposals still pay; no leaf does: a chain


def test_the_leaf_calibration_learns_from_the_leaves_reached():
    """Accepted leaves per unit of their runner-up probability, pooled over the batch by source:
    leaves accepted twice as often as their probability say raise it, leaves never accepted lower
    it, and a lookup row's leaves teach the lookup's calibration only."""
    def policy_after(accepted, lookup_rows=None):
        policy = Goodput(4)
        for _ in range(20):
            policy.record(RoundOutcome(np.arange(2), np.array([2, 2]), np.array([1, 1]), np.full((2, 2), 0.8), 2,
                                       0.01, 6, 0.05, lookup_rows, leaf_confidence=np.array([0.5, 0.5]),
                                       leaves_accepted=np.array([accepted, accepted]) / 2))
        return policy
    high, low = policy_after(2.0).leaf_calibration(3), policy_after(0.0).leaf_calibration(3)
    assert high.shape == (3,) and high[0] == pytest.approx(2.0, rel=0.1) and low[0] < 0.1
    lookup_taught = policy_after(0.0, np.array([False, True]))
    assert lookup_taught.leaf_calibration(1, lookup=True)[0] < 0.2  # both rows' leaves failed ...
    assert lookup_taught.leaves[True].confidence == pytest.approx(lookup_taught.leaves[False].confidence)
    only_lookup = policy_after(0.0, np.array([True, True]))
    assert only_lookup.leaf_calibration(1)[0] > 0.5  # ... the model's calibration heard nothing from lookup rows
    # no leaf evidence yet: the batch's calibration of proposals (1 before any evidence)
    assert Goodput(4).leaf_calibration(2).tolist() == [1.0, 1.0]
    assert Goodput(4).leaf_calibration(2, lookup=True).tolist() == [1.0, 1.0]


def test_a_tree_rounds_leaf_outcome_counts_the_leaves_under_reached_nodes():
    """Leaves under the root and the accepted spine nodes were reached; a path that leaves the spine
    accepted one."""
    from specbatch.fast.engine import Proposals, leaf_outcome
    leaves = np.array([[2, 1, 1], [1, 0, 0]])
    runner_ups = np.array([[[0.3, 0.2], [0.1, 0.05], [0.4, 0.0]], [[0.5, 0.1], [0.2, 0.1], [0.3, 0.1]]])
    proposals = Proposals(None, None, None, np.array([3, 1]), None, 3, 3, np.zeros(2, dtype=bool), None, None,
                          leaves, runner_ups)
    # row 0: spine accepted 1, then a leaf (path 2); row 1: nothing accepted
    confidence, accepted = leaf_outcome(proposals, np.array([2, 0]), np.array([1, 0]))
    assert confidence == pytest.approx([0.3 + 0.2 + 0.1, 0.5]) and accepted.tolist() == [1.0, 0.0]


def test_a_tree_round_teaches_the_policy_its_spine_and_its_leaves_apart():
    """A tree round whose path left the spine after one proposal and accepted a leaf: the row's
    proposal history counts one accepted proposal (not the path's two nodes) and the leaf history
    one accepted leaf."""
    import torch
    from types import SimpleNamespace
    from specbatch.fast.engine import Proposals, Settings, record_round
    policy = Goodput(4)
    settings = Settings(k=3, eos_ids=(), window=None, dtype=torch.float32, device=torch.device("cpu"), fill=-1e9,
                        policy=policy, tree_branches=3)
    clock = SimpleNamespace(last=dict(time_draft=0.01, time_verify=0.02), agree=lambda *s: s)
    proposals = Proposals(None, None, None, np.array([3]), None, 3, 3, np.zeros(1, dtype=bool),
                          np.full((1, 3), 0.7), None, np.array([[2, 2, 0]]), np.array([[[0.2, 0.1]] * 3]))
    record_round(settings, clock, np.array([5]), proposals, np.array([2]), 10, np.array([1]))
    row = policy.rows[(5, False)]
    assert row.accepted == 1.0 and row.reached == 2.0
    assert policy.leaves[False].accepted == 1.0 and policy.leaves[False].confidence == pytest.approx(0.6)
    assert policy.leaves[True].accepted == 0.0 and policy.leaves[True].confidence == 0.0
