"""The reference engine, every strategy, against its own autoregressive decoding (I1-I6, S1-S4)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_cases import TARGET, cases, oracle
from specbatch.invariants import check_composition, check_outputs, check_stop
from specbatch.reference import STRATEGIES, ScriptedDraft, deviate_at, generate, greedy_decode
from profiles import examples


@pytest.mark.parametrize("strategy", STRATEGIES)
@given(case=cases())
def test_every_strategy_equals_greedy_decoding_with_invariants_checked_every_round(strategy, case):
    result = generate(TARGET, case["draft"], case["prompts"], max_new_tokens=case["max_new_tokens"], num_draft_tokens=case["k"],
                      eos_token_id=case["eos_ids"], strategy=strategy, batch_size=case["batch_size"],
                      pad_token_id=case["pad_id"], check_invariants=True)
    want = oracle(case["prompts"], case["max_new_tokens"], case["eos_ids"])
    assert check_outputs(result.sequences, want) == []
    budgets = case["max_new_tokens"]
    for i, seq in enumerate(result.sequences):
        budget = budgets if np.isscalar(budgets) else budgets[i]
        assert check_stop(seq, case["eos_ids"], budget, request=i) == []


@pytest.mark.parametrize("strategy", ["exspec", "ragged"])
@given(case=cases(max_batch=10), data=st.data())
@settings(max_examples=examples(15))
def test_results_do_not_depend_on_batch_size_window_or_arrival_order(strategy, case, data):
    """S4 (and S2: results in input order whatever the arrival order)."""
    base = generate(TARGET, case["draft"], case["prompts"], max_new_tokens=case["max_new_tokens"], num_draft_tokens=case["k"],
                    eos_token_id=case["eos_ids"], strategy=strategy, batch_size=1, pad_token_id=case["pad_id"])
    arrival = data.draw(st.permutations(range(len(case["prompts"]))))
    other = generate(TARGET, case["draft"], case["prompts"], max_new_tokens=case["max_new_tokens"], num_draft_tokens=case["k"],
                     eos_token_id=case["eos_ids"], strategy=strategy, batch_size=data.draw(st.integers(2, 12)),
                     pad_token_id=case["pad_id"], pool_window=data.draw(st.integers(1, 30)),
                     max_wait=data.draw(st.integers(0, 6)), arrival_order=arrival)
    assert check_composition(other.sequences, base.sequences) == []


def test_self_draft_commits_k_plus_one_tokens_per_round():
    prompts = [[1, 2, 3], [4, 5, 6]]
    result = generate(TARGET, TARGET, prompts, max_new_tokens=12, num_draft_tokens=3, strategy="eqspec", batch_size=2)
    assert result.stats["rounds"] == 3  # 12 tokens / (k + 1)
    assert result.stats["accepted_tokens"] == result.stats["drafted_tokens"]


def test_scripted_draft_produces_the_acceptance_pattern_asked_for():
    # prompt of 4 tokens: the first round drafts content indices 4..7; deviating at index 6 accepts 2
    draft = ScriptedDraft(TARGET, deviate_at([6]))
    result = generate(TARGET, draft, [[1, 2, 3, 4]], max_new_tokens=3, num_draft_tokens=4, check_invariants=True)
    assert result.stats["accepted_tokens"] == 2 and result.stats["rounds"] == 1


def test_exspec_groups_equal_lengths_and_bounds_waiting():
    prompts = [[1] * 5, [2] * 5, [3] * 9, [4] * 5, [5] * 2]
    result = generate(TARGET, None, prompts, max_new_tokens=6, strategy="exspec", batch_size=3, max_wait=2,
                      check_invariants=True)
    assert result.stats["grouped_rounds"] > 0
    assert result.stats["max_waited"] <= 2 + 2  # max_wait + ceil(window / batch)
    assert result.sequences == oracle(prompts, 6, ())


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_sliding_window_with_checks_on_gives_windowed_greedy_output(strategy):
    """The I3 checks compare with fresh prefills under the same window, so a windowed run with
    check_invariants=True passes them and equals windowed greedy decoding."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [3] * 12]
    draft = ScriptedDraft(TARGET, deviate_at([9, 12]))
    result = generate(TARGET, draft, prompts, strategy=strategy, max_new_tokens=10, check_invariants=True,
                                window=3, policy="fixed")
    assert result.sequences == [greedy_decode(TARGET, p, 10, window=3) for p in prompts]
