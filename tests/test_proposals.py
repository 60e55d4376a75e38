"""Variable per-row proposal lengths (fast.proposals): the rules, the default policy, every strategy
against transformers' greedy decoding and the reference's rule under fuzzed confidences, traces
checked (I7), and mutants that let a row's length follow a neighbour or verify past its own
proposal caught."""
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specbatch
import specbatch.fast.engine as engine
from hf_models import EOS, VOCAB, oracle, tiny
from profiles import examples, only_full
from specbatch.fast.drafts.scripted import ScriptedDraft
from specbatch.fast.proposals import proposal_lengths
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


def test_a_length_that_follows_a_neighbour_breaks_the_rule():
    confidence = np.array([[0.9, 0.9, 0.1], [0.9, 0.1, 0.9]])
    limit = np.array([3, 3])
    good = proposal_lengths(confidence, limit, 0.5)
    assert list(good) == [2, 1]
    swapped = good[::-1]  # each row took the other's length
    assert [v.invariant for v in check_proposal_lengths(swapped, confidence, limit, 0.5)] == ["I7", "I7"]
    longest = np.full(2, good.max())  # every row verifies the round's longest proposal
    assert [v.row for v in check_proposal_lengths(longest, confidence, limit, 0.5)] == [1]


@pytest.mark.parametrize("strategy", only_full("ragged", "eqspec", "exspec"))
@settings(max_examples=examples(20))  # each example runs a whole generation with invariants checked
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
                                draft_floor=floor, policy="threshold", check_invariants=True, trace=path)
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
                                draft_threshold=0.5, policy="threshold", trace=path)
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


def test_the_checker_holds_a_row_to_a_floor_within_the_run_s(tmp_path):
    target = tiny("llama")
    draft = ScriptedDraft(target, deviate_hashed(1, 0.1), confidence=confidence_hashed(5))
    path = tmp_path / "t.jsonl"
    specbatch.generate(target, draft, PROMPTS[:2], max_new_tokens=8, num_draft_tokens=4, batch_size=2,
                       draft_threshold=0.5, policy="threshold", trace=path)
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
    module = {"eqspec": "rect_proposer", "exspec": "rect_proposer", "ragged": "proposer"}[strategy]
    import importlib
    mod = importlib.import_module(f"specbatch.fast.{module}")
    original = mod.draft_round
    mod.draft_round = spy
    try:
        result = specbatch.generate(target, draft, PROMPTS, max_new_tokens=12, num_draft_tokens=4, batch_size=6,
                                    strategy=strategy, draft_threshold=0.5, policy="threshold")
    finally:
        mod.draft_round = original
    assert result.sequences == oracle(target, PROMPTS, 12, [EOS])
    assert any(len(set(r)) > 1 for r in lengths if len(r) > 1)
    assert result.stats["drafted_tokens"] == sum(sum(r) for r in lengths)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_default_goodput_policy_is_exact_and_its_trace_checks(tmp_path, strategy):
    target = tiny("llama")
    draft = ScriptedDraft(target, deviate_hashed(2, 0.6), confidence=confidence_hashed(1, 0.5, 0.99))
    path = tmp_path / "t.jsonl"
    result = specbatch.generate(target, draft, PROMPTS, max_new_tokens=12, num_draft_tokens=4, batch_size=6,
                                strategy=strategy, check_invariants=True, trace=path)
    assert result.sequences == oracle(target, PROMPTS, 12, [EOS])
    assert result.stats["rounds"] >= 12 / 5
    assert check_trace(path) == []
    rows = [row for rnd in map(json.loads, open(path)) if "round" in rnd for row in rnd["rows"]]
    assert all("bar" in row and "floor" not in row for row in rows)


def neighbour_rule(monkeypatch):
    """Mutant: a row's proposal length follows the next row's confidences."""
    original = engine.draft_round

    def draft_round(*args, **kwargs):
        proposals = original(*args, **kwargs)
        proposals.proposed = np.roll(proposals.proposed, 1) if len(proposals.proposed) > 1 else proposals.proposed
        proposals.proposed = np.minimum(proposals.proposed, proposals.steps)
        return proposals
    for name in ("rect_proposer", "proposer"):
        monkeypatch.setattr(f"specbatch.fast.{name}.draft_round", draft_round)


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


def fixed_prices(monkeypatch):
    """The goodput policy with set numbers instead of measured ones (each row's calibration and worth
    1, bar 0.3, no step price), so that its rule's lengths vary with the scripted confidences."""
    from specbatch.fast.policy import Goodput
    from specbatch.fast.proposals import GoodputRule
    ones = lambda info: np.ones(len(info.clamp))  # noqa: E731
    monkeypatch.setattr(Goodput, "plan", lambda self, info: GoodputRule(info.clamp, ones(info), ones(info),
                                                                        ones(info), 0.3, 0.0))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("policy", ["threshold", "goodput"])
@pytest.mark.parametrize("mutant", [neighbour_rule, verify_past_proposal])
def test_mutants_of_the_proposal_rule_are_caught(monkeypatch, tmp_path, strategy, policy, mutant):
    target = tiny("llama")
    draft = ScriptedDraft(target, deviate_hashed(1, 0.1), confidence=confidence_hashed(5))
    kwargs = dict(max_new_tokens=12, num_draft_tokens=4, batch_size=6, strategy=strategy, draft_threshold=0.5,
                  policy=policy)
    if policy == "goodput":
        fixed_prices(monkeypatch)
    path = tmp_path / "good.jsonl"
    specbatch.generate(target, draft, PROMPTS, trace=path, **kwargs)
    assert check_trace(path) == []
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
    result = reference_generate(target, draft, prompts, max_new_tokens=10, num_draft_tokens=4, eos_token_id=EOS,
                                strategy=strategy, batch_size=3, check_invariants=True, policy="threshold",
                                draft_threshold=0.5, draft_floor=0.5)
    assert result.sequences == want
    fixed = reference_generate(target, draft, prompts, max_new_tokens=10, num_draft_tokens=4, eos_token_id=EOS,
                               strategy=strategy, batch_size=3, policy="fixed")
    assert fixed.sequences == want and result.stats["drafted_tokens"] < fixed.stats["drafted_tokens"]
    floored = reference_generate(target, draft, prompts, max_new_tokens=10, num_draft_tokens=4, eos_token_id=EOS,
                                 strategy=strategy, batch_size=3, check_invariants=True, policy="threshold",
                                 draft_threshold=0.5, draft_floor=0.2)
    assert floored.sequences == want
    assert result.stats["drafted_tokens"] < floored.stats["drafted_tokens"] < fixed.stats["drafted_tokens"]
