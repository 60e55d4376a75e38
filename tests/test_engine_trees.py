"""Token trees in the ragged engine (tree_branches > 1, fast.trees) against transformers' own
greedy decoding and against the reference's tree rounds (reference.trees): every output exact,
every round's accepted path the greedy walk of its tree (I5 for trees, checked live), both caches
a fresh prefill's after every round (I3), and a draft whose second guess is right accepted where a
chain stops."""
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specbatch
from hf_models import EOS, FIXED_K, VOCAB, oracle, save_folder, tiny
from specbatch.fast.drafts.lookup_draft import PromptLookupDraft
from specbatch.fast.drafts.scripted import ScriptedDraft
from specbatch.fast.equivalence import compare
from specbatch.fast.sampling import ranked_siblings
from specbatch.fast.trees import SiblingTrees
from specbatch.reference import ToyLM, deviate_at, deviate_hashed, greedy_decode
from specbatch.reference import ScriptedDraft as ReferenceScriptedDraft
from specbatch.reference import generate as reference_generate
from profiles import examples, grid

RNG = np.random.default_rng(3)
PROMPTS = [RNG.integers(2, VOCAB, n).tolist() for n in (3, 9, 1, 30, 5, 12)]
BUDGETS = [12, 5, 9, 16, 1, 14]


def second_guess(target, rate=0.4, seed=3):
    """The target as its own draft, with its two best tokens swapped where deviate_hashed fires:
    the chain misses there, a leaf does not."""
    return ScriptedDraft(target, deviate_hashed(seed, rate), swap=True)


@pytest.mark.parametrize("arch,branches,draft", grid(arch=["llama", "qwen3", "gpt2", "mistral"], branches=[2, 3],
                                                     draft=["second-guess", "random", "self"]))
def test_trees_equal_transformers_greedy_float64(arch, branches, draft):
    """Uneven prompts, per-row budgets, an EOS, more requests than slots (refill), invariants on;
    mistral with a sliding window of 5 that the sequences pass."""
    target = tiny(arch, **({"sliding_window": 5} if arch == "mistral" else {}))
    chosen = {"second-guess": second_guess(target), "random": tiny(arch, layers=1, seed=5), "self": target}[draft]
    want = oracle(target, PROMPTS, BUDGETS, [EOS])
    result = specbatch.generate(target, chosen, PROMPTS, max_new_tokens=BUDGETS, num_draft_tokens=3, batch_size=4,
                                tree_branches=branches, eos_token_id=[EOS], check_invariants=True, strategy="ragged",
                                **FIXED_K)
    assert result.sequences == want
    proposed = result.stats["drafted_tokens"] / max(result.stats["rounds"], 1)
    assert result.stats["nodes_per_row_round"] > 0 and proposed > 0


def test_a_second_guess_that_is_always_right_commits_two_tokens_a_round():
    """Every proposal misses and every first leaf is the target's token: a chain commits one token a
    round, a tree two (the leaf and the target's next), for every row."""
    target = tiny("llama")
    draft = ScriptedDraft(target, deviate_at(range(1, 200)), swap=True)
    prompts, budget = PROMPTS[:4], 12
    runs = {b: specbatch.generate(target, draft, prompts, max_new_tokens=budget, num_draft_tokens=3, batch_size=4,
                                  tree_branches=b, strategy="ragged", check_invariants=True, **FIXED_K)
            for b in (1, 2)}
    want = oracle(target, prompts, budget, [])
    assert runs[1].sequences == want and runs[2].sequences == want
    assert [r["rounds"] for r in runs[1].request_stats] == [budget] * 4
    assert [r["rounds"] for r in runs[2].request_stats] == [budget // 2] * 4
    assert runs[2].stats["nodes_per_row_round"] > 2 * runs[1].stats["nodes_per_row_round"] - 1e-9


def test_a_round_whose_draft_ran_but_proposed_nothing_verifies_roots_alone():
    """The threshold policy with a floor of 1: every row's first step stops it without a proposal."""
    target = tiny("llama")
    result = specbatch.generate(target, second_guess(target), PROMPTS, max_new_tokens=BUDGETS, tree_branches=2,
                                policy="threshold", draft_threshold=1.0, draft_floor=1.0, check_invariants=True)
    assert result.sequences == oracle(target, PROMPTS, BUDGETS, [])
    assert result.stats["drafted_tokens"] == 0 and result.stats["nodes_per_row_round"] == 0


def test_trees_accept_more_than_the_chain_with_the_same_draft():
    target = tiny("llama")
    runs = {b: specbatch.generate(target, second_guess(target), PROMPTS, max_new_tokens=BUDGETS, num_draft_tokens=4,
                                  batch_size=3, tree_branches=b, strategy="ragged", **FIXED_K) for b in (1, 2)}
    assert runs[1].sequences == runs[2].sequences
    assert runs[2].stats["accepted_tokens"] > runs[1].stats["accepted_tokens"]
    assert runs[2].stats["rounds"] < runs[1].stats["rounds"]


@given(deviations=st.sets(st.integers(1, 60), max_size=30), k=st.integers(1, 6), batch=st.integers(1, 6),
       branches=st.integers(2, 4), budgets=st.lists(st.integers(1, 14), min_size=6, max_size=6))
@settings(max_examples=examples(16), deadline=None)
def test_fuzzed_trees_against_greedy_decoding(deviations, k, batch, branches, budgets):
    """Random acceptance patterns (the draft's second guess right where it deviates), k, slots,
    branches and budgets: exact, with every round's tree checked (I2-I5)."""
    target = tiny("llama")
    full = oracle(target, PROMPTS, 14, [EOS])
    result = specbatch.generate(target, ScriptedDraft(target, deviate_at(deviations), swap=True), PROMPTS,
                                max_new_tokens=budgets, num_draft_tokens=k, batch_size=batch, tree_branches=branches,
                                eos_token_id=[EOS], check_invariants=True, strategy="ragged", **FIXED_K)
    assert result.sequences == [s[:b] for s, b in zip(full, budgets)]


@pytest.mark.parametrize("branches,draft,top_k", grid(branches=[2, 3], draft=["second-guess", "random"], top_k=[None, 12]))
def test_coupled_trees_equal_target_only_coupled_sampling(branches, draft, top_k):
    """Coupled mode: every node takes the target's coupled choice for the position it predicts (one
    Gumbel vector per (seed, request, position)), so the tree commits exactly target-only coupled
    sampling's tokens, with one seed for all requests or one per request."""
    target = tiny("llama")
    chosen = second_guess(target) if draft == "second-guess" else tiny("llama", layers=1, seed=5)
    for seed in (11, [5, 6, 7, 8, 9, 10]):
        sampled = dict(temperature=0.9, top_k=top_k, sampling="coupled", seed=seed, max_new_tokens=BUDGETS,
                       eos_token_id=[EOS])
        alone = specbatch.generate(target, None, PROMPTS, batch_size=2, **sampled)
        tree = specbatch.generate(target, chosen, PROMPTS, batch_size=4, tree_branches=branches, num_draft_tokens=3,
                                  check_invariants=True, **sampled, **FIXED_K)
        assert tree.sequences == alone.sequences
        assert tree.stats["accepted_tokens"] > 0


@pytest.mark.parametrize("kind,lookup", grid(kind=["feature", "head", "conditioned"], lookup=[False, True]))
def test_trees_with_drafts_that_read_the_targets_features(kind, lookup):
    """Every node's target features are captured at its scratch slot and the accepted path's move
    to its content indices (FeatureBuffer.keep_path): the draft reads the true features of the
    content next round (the draft-cache I3 check compares with a fresh prefill over them)."""
    from specbatch.fast.drafts.lookup_draft import LookupFirstDraft
    from test_feature_draft import DRAFTS, PROMPTS as FEATURE_PROMPTS
    target = tiny("llama", layers=2, seed=7)
    draft = DRAFTS[kind](target, 4)
    draft = LookupFirstDraft(draft) if lookup else draft
    for branches in (1, 3):
        out = specbatch.generate(target, draft, FEATURE_PROMPTS, max_new_tokens=16, batch_size=2, num_draft_tokens=4,
                                 tree_branches=branches, check_invariants=True, eos_token_id=[EOS], **FIXED_K)
        assert out.sequences == oracle(target, FEATURE_PROMPTS, 16, [EOS])
        assert out.stats["nodes_per_row_round"] > 0
    assert not target.model.norm._forward_hooks


@pytest.mark.parametrize("draft", ["second-guess", "random", "feature"])
def test_rejection_trees_run_with_every_check(draft):
    """Rejection sampling over trees (the distribution itself: tests/test_sampling.py): every round's
    accepted path runs down the tree's parent links and commits its tokens then the sampled one
    (check_tree_commit without node choices), both caches stay a fresh prefill's (I3), and a draft
    equal to the target (q = p) accepts every proposal."""
    from test_feature_draft import DRAFTS
    target = tiny("llama")
    chosen = {"second-guess": second_guess(target), "random": tiny("llama", layers=1, seed=5),
              "feature": DRAFTS["feature"](target, 4)}[draft]
    sampled = dict(temperature=0.8, top_p=0.9, sampling="rejection", seed=3, max_new_tokens=BUDGETS,
                   eos_token_id=[EOS], num_draft_tokens=3, check_invariants=True, **FIXED_K)
    result = specbatch.generate(target, chosen, PROMPTS, batch_size=4, tree_branches=3, **sampled)
    assert all(len(s) <= b for s, b in zip(result.sequences, BUDGETS)) and result.stats["nodes_per_row_round"] > 3
    same = specbatch.generate(target, target, PROMPTS, batch_size=4, tree_branches=2, **sampled)
    assert same.stats["acceptance_rate"] > 0.999


def test_float32_trees_match_target_only_decoding_up_to_ties():
    target = tiny("llama", dtype=torch.float32)
    reference = specbatch.generate(target, None, PROMPTS, max_new_tokens=BUDGETS, batch_size=1)
    result = specbatch.generate(target, second_guess(target), PROMPTS, max_new_tokens=BUDGETS, num_draft_tokens=4,
                                batch_size=4, tree_branches=3, **FIXED_K)
    reports = compare(target, PROMPTS, result.sequences, reference.sequences)
    assert [r for r in reports if not r["exact"] and r["kind"] == "error"] == []


def test_the_reference_tree_rounds_equal_greedy_decoding_and_accept_more():
    """reference.generate(tree_branches=b): the NumPy twin of the engine's sibling-leaf trees."""
    target = ToyLM(seed=1)
    draft = ReferenceScriptedDraft(target, deviate_hashed(3, 0.4), swap=True)
    prompts = [RNG.integers(0, 48, n).tolist() for n in (3, 7, 5, 9, 2)]
    budgets = [12, 5, 9, 20, 1]
    accepted = {}
    for branches in (1, 2, 3):
        for window in (None, 4):
            run = reference_generate(target, draft, prompts, max_new_tokens=budgets, strategy="ragged",
                                     policy="fixed", tree_branches=branches, batch_size=3, check_invariants=True,
                                     eos_token_id=[7], window=window, num_draft_tokens=3)
            assert run.sequences == [greedy_decode(target, p, m, (7,), window) for p, m in zip(prompts, budgets)]
            accepted[branches, window] = run.stats["accepted_tokens"]
    assert accepted[2, None] > accepted[1, None] and accepted[2, 4] > accepted[1, 4]
    with pytest.raises(ValueError, match="tree_branches=2 runs in strategy='ragged'"):
        reference_generate(target, draft, prompts, strategy="eqspec", policy="fixed", tree_branches=2)


def test_siblings_are_the_next_most_likely_tokens_without_the_proposal():
    logits = torch.tensor([[0.0, 5.0, 3.0, 4.0, 1.0], [9.0, 1.0, 2.0, 3.0, 0.0]])
    assert ranked_siblings(logits, torch.tensor([1, 3]), 2).tolist() == [[3, 2], [0, 2]]  # proposal dropped
    assert ranked_siblings(logits, torch.tensor([4, 4]), 2).tolist() == [[1, 3], [0, 3]]  # not in the top


def test_runner_ups_are_the_draft_distributions_second_and_later_probabilities():
    """What the goodput rule prices leaves by: the 2nd, 3rd, ... largest probabilities, the mode left
    out, of the distribution each mode drafts from (at temperature 1, the softmax)."""
    from specbatch.fast.sampling import Coupled, Greedy, Rejection
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.05, 0.15, 0.2, 0.6]], dtype=torch.float64)
    requests, seeds = torch.arange(2), torch.tensor([1, 2])
    want = [[0.3, 0.1], [0.2, 0.15]]
    for chooser in (Greedy(), Coupled(1.0, None, None, seeds), Rejection(1.0, None, None, seeds)):
        got = chooser.runner_ups(probs.log(), requests, 2)
        assert np.allclose(got.numpy(), want, atol=1e-6), type(chooser).__name__


def test_sibling_trees_number_the_spine_first_and_take_the_rules_leaves():
    trees = SiblingTrees.of(proposed=[2, 0, 2], branches=3, content=[5, 3, 8], leaves=[[2, 2], [0, 0], [0, 0]])
    assert [p.tolist() for p in trees.parents] == [[-1, 0, 1, 0, 0, 1, 1], [-1], [-1, 0, 1]]
    # candidate matrix: pending, d_1, d_2, then step 0's two siblings, step 1's two
    assert trees.source[0].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert trees.source[2, :3].tolist() == [0, 1, 2]
    assert trees.layout.position[:7].tolist() == [4, 5, 6, 5, 5, 6, 6]


@given(st.lists(st.tuples(st.integers(0, 4), st.lists(st.integers(0, 2), min_size=4, max_size=4)),
                min_size=1, max_size=5))
@settings(max_examples=examples(40), deadline=None)
def test_sibling_trees_with_the_rules_leaves_are_the_references_trees(rows):
    """Whatever leaves per step the proposal rule chose, the engine's trees (parents, and tokens
    through the candidate matrix) are reference.trees.sibling_tree's."""
    from specbatch.reference.trees import sibling_tree
    proposed = np.array([p for p, _ in rows])
    leaves = np.array([c for _, c in rows])
    trees = SiblingTrees.of(proposed, 3, np.full(len(rows), 9), leaves)
    pending = torch.arange(len(rows)) + 100
    drafted = torch.arange(len(rows) * 4).reshape(-1, 4) + 200
    siblings = torch.arange(len(rows) * 8).reshape(-1, 4, 2) + 300
    tokens = trees.candidates(pending, drafted, siblings).gather(1, torch.as_tensor(trees.source))
    for i in range(len(rows)):
        want = sibling_tree(int(pending[i]), drafted[i, :proposed[i]], siblings[i, :proposed[i]], leaves[i])
        assert trees.parents[i].tolist() == want.parent.tolist()
        assert tokens[i, :want.size].tolist() == want.tokens.tolist()


def goodput_at_set_prices(monkeypatch, bar: float) -> list:
    """The goodput policy with set numbers (calibrations and worth 1, the given bar, no step price)
    in place of measured ones, so that its leaves vary with the draft's runner-up probabilities;
    returns the list each step's leaf counts are appended to."""
    from specbatch.fast.policy import Goodput
    from specbatch.fast.proposals import GoodputRule
    ones = lambda info: np.ones(len(info.clamp))  # noqa: E731
    monkeypatch.setattr(Goodput, "plan", lambda self, info: GoodputRule(info.clamp, ones(info), ones(info),
                                                                        ones(info), bar, 0.0))
    seen, real = [], GoodputRule.leaves

    def leaves(self, j, runner_ups, proposes, most):
        count = real(self, j, runner_ups, proposes, most)
        seen.append(count[proposes])
        return count
    monkeypatch.setattr(GoodputRule, "leaves", leaves)
    return seen


@pytest.mark.parametrize("mode", ["greedy", "coupled", "rejection"])
def test_goodput_trees_choose_each_steps_leaves_and_stay_exact(monkeypatch, mode):
    """Under the goodput policy (greedy's and coupled's default) each step's leaves are the rule's (checked live, I7):
    chains and trees of both widths run in one batch, and greedy and coupled outputs stay target-only's."""
    seen = goodput_at_set_prices(monkeypatch, bar=0.05)
    target = tiny("llama", initializer_range=0.5)  # peaked distributions: runner-ups of 0.03-0.2
    sampled = {} if mode == "greedy" else dict(temperature=0.9, sampling=mode, seed=4)
    result = specbatch.generate(target, second_guess(target), PROMPTS, max_new_tokens=BUDGETS, num_draft_tokens=3,
                                batch_size=4, tree_branches=3, eos_token_id=[EOS], check_invariants=True,
                                policy="goodput", **sampled)
    assert {0, 1, 2} <= set(np.concatenate(seen).tolist())
    assert result.stats["leaves_verified"] == int(np.concatenate(seen).sum())  # the rule's leaves, all verified
    alone = specbatch.generate(target, None, PROMPTS, max_new_tokens=BUDGETS, batch_size=2, eos_token_id=[EOS],
                               **sampled)
    if mode != "rejection":
        assert result.sequences == alone.sequences


@pytest.mark.parametrize("mode", ["greedy", "rejection"])
def test_a_round_without_leaves_is_verified_as_chains(monkeypatch, mode):
    """Where the rule gives no row a leaf the round runs the chain verify (no tree machinery), with
    the chain's draws: tree_branches = 3 then gives tree_branches = 1's tokens, sampled ones too."""
    from specbatch.fast.strategies.ragged import RaggedEngine
    goodput_at_set_prices(monkeypatch, bar=0.55)  # a runner-up (at most 1/2) never pays; a sure proposal does
    monkeypatch.setattr(RaggedEngine, "verify_tree", lambda *a: pytest.fail("a round without leaves verified a tree"))
    target = tiny("llama", initializer_range=0.5)
    sampled = {} if mode == "greedy" else dict(temperature=0.9, sampling=mode, seed=4)
    runs = [specbatch.generate(target, second_guess(target), PROMPTS, max_new_tokens=BUDGETS, num_draft_tokens=3,
                               batch_size=4, tree_branches=b, eos_token_id=[EOS], check_invariants=True,
                               policy="goodput", **sampled) for b in (1, 3)]
    assert runs[0].sequences == runs[1].sequences and runs[1].stats["leaves_verified"] == 0
    assert runs[1].stats["drafted_tokens"] > 0


def test_a_leaf_count_that_is_not_the_rules_is_caught(monkeypatch):
    """One more leaf than the goodput rule pays for: the live I7 check names it."""
    from specbatch.fast.proposals import GoodputRule
    from specbatch.invariants import InvariantError
    goodput_at_set_prices(monkeypatch, bar=0.05)  # leaves that do not pay: one more is a wrong count
    real = GoodputRule.leaves
    monkeypatch.setattr(GoodputRule, "leaves", lambda self, j, r, proposes, most: np.minimum(
        real(self, j, r, proposes, most) + proposes, most))
    target = tiny("llama", initializer_range=0.5)
    with pytest.raises(InvariantError, match="leaf count"):
        specbatch.generate(target, second_guess(target), PROMPTS, max_new_tokens=BUDGETS, num_draft_tokens=3,
                           batch_size=4, tree_branches=3, check_invariants=True)


@pytest.mark.parametrize("bad, why", [
    (dict(strategy="eqspec"), "needs a strategy that verifies trees"),
    (dict(repetition_penalty=1.3), "penalties"),
    (dict(trace="TRACE"), "trace"),
    (dict(tree_branches=VOCAB + 1), "exceeds the candidates"),
])
def test_what_trees_do_not_run_with_is_refused_by_name(bad, why, tmp_path):
    target = tiny("llama")
    bad = {key: str(tmp_path / "t.jsonl") if value == "TRACE" else value for key, value in bad.items()}
    call = dict(tree_branches=2, max_new_tokens=3, **FIXED_K) | bad
    with pytest.raises(ValueError, match=why):
        specbatch.generate(target, target, PROMPTS[:2], **call)
    with pytest.raises(ValueError, match="tree_branches must be an integer >= 1"):
        specbatch.generate(target, target, PROMPTS[:2], tree_branches=0)


def test_a_draft_that_ranks_no_candidates_proposes_a_chain():
    """Prompt lookup alone has one candidate per step: tree_branches changes nothing it verifies."""
    target = tiny("llama")
    lookup = PromptLookupDraft(VOCAB, device=target.device, generation_config=target.generation_config)
    prompts = [p * 3 for p in PROMPTS[:3]]
    runs = [specbatch.generate(target, lookup, prompts, max_new_tokens=8, tree_branches=b, **FIXED_K) for b in (1, 3)]
    assert runs[0].sequences == runs[1].sequences
    assert runs[0].stats["nodes_per_row_round"] == runs[1].stats["nodes_per_row_round"]
    assert runs[1].stats["leaves_verified"] == runs[1].stats["leaves_accepted"] == 0


@pytest.mark.full  # slow (a subprocess or many runs): the pre-merge profile
def test_cli_tree_branches(tmp_path):
    """--tree-branches is a generate/verify/bench flag: a bad value exits 2 naming it, no traceback."""
    folder = tmp_path / "model"
    save_folder(folder, tiny("llama"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("w3 w4 w5\nw9 w2\n")
    run = lambda *args: subprocess.run([sys.executable, "-m", "specbatch", *args], capture_output=True,  # noqa: E731
                                       text=True, timeout=300)
    base = ["verify", "--target", str(folder), "--draft", str(folder), "--prompts", str(prompts),
            "--max-new-tokens", "6"]
    ok = run(*base, "--tree-branches", "2")
    assert ok.returncode == 0, ok.stderr
    bad = run(*base, "--tree-branches", "0")
    assert bad.returncode == 2 and "--tree-branches" in bad.stderr and "Traceback" not in bad.stderr
    refused = run(*base, "--tree-branches", "2", "--strategy", "exspec")
    assert refused.returncode != 0 and "tree_branches=2" in refused.stderr and "Traceback" not in refused.stderr


def test_the_tree_commit_checker_names_a_wrong_path_and_a_wrong_commit():
    from specbatch.invariants import check_tree_commit
    parents = [np.array([-1, 0, 1, 0])]  # root -> 1 -> 2, root -> 3
    tokens = np.array([[9, 4, 5, 6]])
    choice = np.array([[6, 0, 0, 8]])  # the target takes 6 after the root (node 3), then 8
    assert check_tree_commit(parents, tokens, choice, [1], [[6, 8]], [5], ()) == []
    short = check_tree_commit(parents, tokens, choice, [0], [[6]], [5], ())
    assert [v.invariant for v in short] == ["I5"] and short[0].expected == 1
    spine = check_tree_commit(parents, tokens, choice, [1], [[4, 5]], [5], ())
    assert [v.invariant for v in spine] == ["I5"]
    past_eos = check_tree_commit(parents, tokens, choice, [1], [[6, 8]], [5], (6,))
    assert [v.invariant for v in past_eos] == ["I6"]
    # rejection sampling: no node choices; the path must run down parent links, its tokens committed
    sampled = np.array([[4, 5, 3]])  # path 1 -> 2, then the sampled token 3
    assert check_tree_commit(parents, tokens, None, [2], [[4, 5, 3]], [5], (), path=[[1, 2]], choice=sampled) == []
    broken = check_tree_commit(parents, tokens, None, [2], [[4, 5, 3]], [5], (), path=[[3, 2]], choice=sampled)
    assert [v.invariant for v in broken] == ["I5"]
    miscounted = check_tree_commit(parents, tokens, None, [1], [[4, 3]], [5], (), path=[[1, 2]], choice=sampled)
    assert [v.invariant for v in miscounted] == ["I5"]


def test_after_tree_rounds_the_feature_buffer_holds_the_targets_features_of_the_content():
    """A leaf accepted at depth d leaves the spine node's features at content index c - 1 + d unless
    the path's features move (FeatureBuffer.keep_path): each finished row's buffer must equal the
    target's features of its content."""
    from specbatch.fast.compute.attention import engine_attention
    from specbatch.fast.engine import Clock, Settings, Stats
    from specbatch.fast.models import ModelRunner, mask_fill_value
    from specbatch.fast.strategies.ragged import RaggedEngine
    from test_feature_draft import PROMPTS as FEATURE_PROMPTS, feature_draft
    target = tiny("llama", layers=2, seed=6)
    draft, _ = feature_draft(target, seed=3)
    settings = Settings(k=3, eos_ids=(), window=None, dtype=torch.float64, device=torch.device("cpu"),
                        fill=mask_fill_value(torch.float64), tree_branches=24)
    stats = Stats()
    checked = []

    def on_done(request, tokens, reason, rounds):
        slot = int(np.nonzero(engine.request == request)[0][0])
        content = FEATURE_PROMPTS[request] + tokens
        checked.append((request, content, engine.proposer.features.data[slot, :len(content) - 1].clone()))

    with torch.no_grad(), engine_attention(target, draft):
        engine = RaggedEngine(ModelRunner(target), ModelRunner(draft), FEATURE_PROMPTS, [12] * len(FEATURE_PROMPTS),
                              settings, stats, Clock(stats, settings.device), slots=2)
        engine.run(on_done)
    assert sorted(r for r, _, _ in checked) == list(range(len(FEATURE_PROMPTS)))
    with torch.no_grad():  # outside the engine's attention: transformers' own forward
        for _, content, held in checked:
            want = target.model(input_ids=torch.tensor([content[:-1]])).last_hidden_state[0]
            torch.testing.assert_close(held, want, rtol=1e-7, atol=1e-9)
    assert stats.accepted_tokens > 0
