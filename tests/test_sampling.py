"""Sampling: the exact target distribution (rejection mode), token identity with target-only
sampling (coupled mode), keyed randomness (S4), and statistical tests with the power to reject
plausible bugs."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch

import specbatch
import specbatch.fast.sampling as sampling
from profiles import only_full
from hf_models import EOS, tiny
from specbatch.fast.drafts.scripted import IMPOSED_P, IMPOSED_Q, ImposedLM, ScriptedDraft
from specbatch.reference import deviate_hashed
from specbatch.reference import sampling as ref

# ---------------------------------------------------------------- closed form, many (p, q)


def imposed_pairs():
    rng = np.random.default_rng(0)
    pairs = []
    for v in (2, 3, 7, 50):
        for _ in range(20):
            pairs.append((rng.dirichlet(np.full(v, 0.5)), rng.dirichlet(np.full(v, 0.5))))
    pairs.append((np.array([0.5, 0.5, 0, 0]), np.array([0, 0, 0.3, 0.7])))  # disjoint supports
    pairs.append((np.array([1.0, 0, 0]), np.array([0.2, 0.3, 0.5])))  # deterministic target
    pairs.append((np.array([0.2, 0.3, 0.5]), np.array([0.2, 0.3, 0.5])))  # identical
    logits = torch.tensor(rng.normal(0, 2, (10, 30)))
    for top_k, top_p in ((3, None), (None, 0.6), (5, 0.8)):  # truncated target and draft
        p = sampling.processed_log_probs(logits[:5], 0.7, top_k, top_p).exp().numpy()
        q = sampling.processed_log_probs(logits[5:], 1.3, top_k, top_p).exp().numpy()
        pairs += list(zip(p, q))
    return pairs


def test_one_round_distribution_is_exactly_the_target_distribution():
    for p, q in imposed_pairs():
        got = sampling.one_round_distribution(torch.tensor(p)[None], torch.tensor(q)[None])[0].numpy()
        np.testing.assert_allclose(got, p, atol=1e-12)
        np.testing.assert_allclose(ref.one_round_distribution(p, q), p, atol=1e-12)


@pytest.mark.parametrize("mutant", ["resample_from_p", "no_renormalization"])
def test_closed_form_rejects_a_broken_residual(monkeypatch, mutant):
    if mutant == "resample_from_p":
        monkeypatch.setattr(sampling, "residual_distribution", lambda p, q: p)
    else:
        monkeypatch.setattr(sampling, "residual_distribution", lambda p, q: (p - q).clamp(min=0))
    worst = max(np.abs(sampling.one_round_distribution(torch.tensor(p)[None], torch.tensor(q)[None])[0].numpy()
                       - p).max() for p, q in imposed_pairs())
    assert worst > 0.05


def test_top_k_top_p_processing():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    kept = sampling.processed_log_probs(logits, 1.0, 2, None).exp()[0]
    assert (kept[2:] == 0).all() and abs(float(kept.sum()) - 1) < 1e-12
    probs = logits.softmax(-1)[0].double()  # 0.64, 0.24, 0.09, 0.03
    nucleus = sampling.processed_log_probs(logits, 1.0, None, 0.8).exp()[0]
    assert (nucleus[:2] > 0).all() and (nucleus[2:] == 0).all()  # 0.64 < 0.8 <= 0.64 + 0.24
    np.testing.assert_allclose(nucleus[:2].numpy(), (probs[:2] / probs[:2].sum()).numpy())


def stated_processor(logits, temperature, top_k, top_p):
    """The processors as the documentation states them, one row at a time in plain Python: divide by
    the temperature; keep the tokens whose logit is at least the k-th largest; then keep the most
    likely tokens, in order, until their probability reaches top_p (the one that reaches it
    included); renormalise."""
    out = []
    for row in logits.tolist():
        scaled = [x / temperature for x in row]
        kept = set(range(len(row)))
        if top_k is not None:
            kth = sorted(scaled, reverse=True)[min(top_k, len(row)) - 1]
            kept = {i for i in kept if scaled[i] >= kth}
        if top_p is not None:
            z = sum(math.exp(scaled[i]) for i in kept)
            mass, nucleus = 0.0, set()
            for i in sorted(kept, key=lambda i: -scaled[i]):
                if mass >= top_p:
                    break
                nucleus.add(i)
                mass += math.exp(scaled[i]) / z
            kept = nucleus
        z = sum(math.exp(scaled[i]) for i in kept)
        out.append([math.exp(scaled[i]) / z if i in kept else 0.0 for i in range(len(row))])
    return np.array(out)


@given(seed=st.integers(0, 10**6), vocab=st.integers(1, 40), top_k=st.one_of(st.none(), st.integers(1, 45)),
       top_p=st.one_of(st.none(), st.floats(0.01, 1.0)), temperature=st.floats(0.2, 3.0))
def test_processors_match_their_independent_statement(seed, vocab, top_k, top_p, temperature):
    logits = torch.tensor(np.random.default_rng(seed).normal(0, 3, (3, vocab)))
    got = sampling.processed_log_probs(logits, temperature, top_k, top_p).exp().numpy()
    want = stated_processor(logits, temperature, top_k, top_p)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got > 0, want > 0)  # the same kept set: one token too few or many fails
    np.testing.assert_allclose(got, want, atol=1e-12)


@pytest.mark.parametrize("strategy", ["eqspec", "exspec", "ragged"])
@pytest.mark.parametrize("mode", ["rejection", "coupled"])
def test_top_k_1_sampling_is_greedy_decoding(strategy, mode):
    target = tiny("llama")
    draft = ScriptedDraft(target, deviate_hashed(3, 0.4))
    greedy = specbatch.generate(target, None, PROMPTS, max_new_tokens=10, eos_token_id=EOS)
    sampled = specbatch.generate(target, draft, PROMPTS, max_new_tokens=10, eos_token_id=EOS, temperature=1.3,
                                 top_k=1, sampling=mode, strategy=strategy, batch_size=3, seed=5)
    assert sampled.sequences == greedy.sequences


# ---------------------------------------------------------------- the torch step against the NumPy step


def test_rejection_step_matches_the_reference_step():
    rng = np.random.default_rng(1)
    chooser = sampling.Rejection(1.0, None, None, torch.tensor([3, 4, 5, 6]))
    for _ in range(30):
        k, v = 3, 6
        p = torch.tensor(rng.dirichlet(np.ones(v), (4, k + 1)))
        q = torch.tensor(rng.dirichlet(np.ones(v), (4, k)))
        drafted = torch.tensor(rng.integers(0, v, (4, k)))
        limit = torch.tensor(rng.integers(0, k + 1, 4))
        requests, first = torch.arange(4), torch.tensor(rng.integers(0, 50, 4))
        choice, accepted = chooser.verify(p.log(), drafted, q, limit, requests, first)
        for i in range(4):
            pos = first[i] + torch.arange(k + 1)
            u_acc = sampling.rng.uniform(chooser.seeds[i].expand(k), torch.full((k,), i), pos[:k], "accept").numpy()
            a = int(accepted[i])
            u_s = float(sampling.rng.uniform(chooser.seeds[i], torch.tensor(i), pos[a], "sample"))
            want_a, want = ref.rejection_step(p[i].numpy(), q[i].numpy(), drafted[i].tolist(), int(limit[i]), u_acc, u_s)
            assert (a, choice[i, :a + 1].tolist()) == (want_a, want)


# ---------------------------------------------------------------- the whole generate path, statistically

VOCAB3 = 3
# imposed next-token tables [position, previous token, next token]: deliberately different p and q
P_TABLE, Q_TABLE = IMPOSED_P, IMPOSED_Q


def joint_counts(sequences):
    counts = np.zeros((VOCAB3,) * 3)
    for s in sequences:
        counts[tuple(s)] += 1
    return counts


def expected_joint(first=0):
    """Target-only joint distribution of 3 new tokens after the prompt [first] (position 0)."""
    joint = np.zeros((VOCAB3,) * 3)
    for a in range(3):
        for b in range(3):
            for c in range(3):
                joint[a, b, c] = P_TABLE[0, first, a] * P_TABLE[1, a, b] * P_TABLE[2, b, c]
    return joint


CHI2_CRITICAL_DF26_ALPHA_0001 = 54.052  # chi2.ppf(0.999, 26)
# Sample size: the chi-square noncentrality of a deviation of total variation d is
# N * sum((p' - p)^2 / p) >= 4 N d^2 (Cauchy-Schwarz, sum p = 1). Rejecting at alpha = 0.001 with
# power > 0.999 on 26 degrees of freedom needs a noncentrality of about 75, so d >= 0.03 needs
# N >= 75 / (4 * 0.03^2) ~ 21,000: we draw 24,000 sequences.
SAMPLES = 24_000


def chi_square(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def sample_joint(strategy="ragged", seed=0, **options):
    prompts = [[0]] * SAMPLES  # every request id gives its own keyed randomness
    result = specbatch.generate(ImposedLM(P_TABLE), ImposedLM(Q_TABLE), prompts, max_new_tokens=3,
                                num_draft_tokens=2, batch_size=4000, strategy=strategy, temperature=1.0,
                                seed=seed, eos_token_id=[], **options)
    return joint_counts(result.sequences), result


@pytest.mark.parametrize("strategy", ["eqspec", "ragged"])
def test_rejection_sampling_has_the_target_joint_distribution(strategy):
    counts, result = sample_joint(strategy)
    assert result.stats["acceptance_rate"] < 0.9  # p and q really differ: rejections happen
    assert chi_square(counts, expected_joint()) < CHI2_CRITICAL_DF26_ALPHA_0001


@pytest.mark.parametrize("mutant", ["resample_from_p_on_reject", "bonus_from_q", "no_renormalization"])
def test_chi_square_rejects_broken_samplers(monkeypatch, mutant):
    if mutant == "resample_from_p_on_reject":
        monkeypatch.setattr(sampling, "residual_distribution", lambda p, q: p)
    elif mutant == "bonus_from_q":
        monkeypatch.setattr(sampling, "next_distribution", lambda p, q, rejected: torch.where(
            rejected[:, None], sampling.residual_distribution(p, q), q))
    else:
        monkeypatch.setattr(sampling, "residual_distribution", lambda p, q: (p - q).clamp(min=0))
    counts, _ = sample_joint()
    assert chi_square(counts, expected_joint()) > CHI2_CRITICAL_DF26_ALPHA_0001


# The imposed draft's most likely token has probability 0.5 to 0.8 depending on the context, so a
# threshold of 0.65 makes rows stop drafting at different steps, and a floor of 0.55 proposes the
# stopping step's token in some contexts (0.6) and not in others (0.5) (proofs_notes/proposals.md:
# the proposal length is a function of the context, not of the token drawn, so no bias).
THRESHOLD, FLOOR = 0.65, 0.55


@pytest.mark.parametrize("strategy", only_full("eqspec", "ragged"))
def test_a_confidence_threshold_keeps_the_target_distribution(strategy):
    _, every_step = sample_joint(strategy, draft_threshold=0.0)
    drafted = []
    for floor in (THRESHOLD, FLOOR):
        counts, result = sample_joint(strategy, draft_threshold=THRESHOLD, draft_floor=floor)
        drafted.append(result.stats["drafted_tokens"])
        assert chi_square(counts, expected_joint()) < CHI2_CRITICAL_DF26_ALPHA_0001
    all_drafted = every_step.stats["drafted_tokens"]
    assert 0.2 * all_drafted < drafted[0] < drafted[1] < 0.9 * all_drafted  # rows stop at different steps


def test_chi_square_rejects_a_threshold_on_the_drawn_token(monkeypatch):
    """The plausible bug: judging the confidence of the token actually drawn (q(d) >= threshold)
    makes proposing depend on the draw, which biases the committed distribution."""
    def draft(self, logits, requests, positions):
        q = self.log_probs(logits, requests).exp()
        u = sampling.rng.uniform(*self.keys(requests), positions, "draft")
        token = sampling.sample_from(q, u)
        return token, q, q.gather(-1, token[:, None])[:, 0]
    monkeypatch.setattr(sampling.Rejection, "draft", draft)
    counts, _ = sample_joint(draft_threshold=THRESHOLD, draft_floor=THRESHOLD)
    assert chi_square(counts, expected_joint()) > CHI2_CRITICAL_DF26_ALPHA_0001


# ---------------------------------------------------------------- coupled mode and keyed randomness

PROMPTS = [[1, 2, 3], [EOS, 9], [20] * 30, [4]]


@pytest.mark.parametrize("strategy", ["eqspec", "exspec", "ragged"])
def test_coupled_equals_target_only_coupled_sampling(strategy):
    target = tiny("llama")
    want = specbatch.generate(target, None, PROMPTS, max_new_tokens=12, temperature=0.9, top_k=20,
                              sampling="coupled", seed=7, batch_size=1).sequences
    for draft in (tiny("llama", layers=1, seed=4), target, ScriptedDraft(target, deviate_hashed(3, 0.3))):
        for batch in (1, 2, 5, 8):
            got = specbatch.generate(target, draft, PROMPTS, max_new_tokens=12, num_draft_tokens=3, batch_size=batch,
                                     strategy=strategy, temperature=0.9, top_k=20, sampling="coupled", seed=7)
            assert got.sequences == want


@pytest.mark.parametrize("mode", ["rejection", "coupled"])
def test_same_seed_same_tokens_at_any_batch_size(mode):
    target = tiny("qwen3")
    draft = tiny("qwen3", layers=1, seed=4)
    outs = [specbatch.generate(target, draft, PROMPTS, max_new_tokens=10, num_draft_tokens=3, batch_size=b,
                               temperature=1.0, sampling=mode, seed=[3, 4, 5, 6]).sequences for b in (1, 2, 8)]
    assert outs[0] == outs[1] == outs[2]
    other = specbatch.generate(target, draft, PROMPTS, max_new_tokens=10, num_draft_tokens=3, batch_size=2,
                               temperature=1.0, sampling=mode, seed=[30, 40, 50, 60]).sequences
    assert other != outs[0]


def test_temperature_zero_is_greedy():
    target = tiny("llama")
    greedy = specbatch.generate(target, target, PROMPTS, max_new_tokens=8).sequences
    assert specbatch.generate(target, target, PROMPTS, max_new_tokens=8, temperature=0.0, seed=9,
                              sampling="coupled").sequences == greedy


# ---------------------------------------------------------------- token trees (fast.trees), rejection mode

@pytest.mark.parametrize("branches", [2, 3])
def test_rejection_over_a_tree_has_the_target_joint_distribution(branches):
    """Multi-candidate rejection (proofs_notes/trees.md, Lemma T6): every candidate drawn from q
    independently, each tested against the residual the rejected ones left."""
    counts, result = sample_joint(tree_branches=branches, policy="fixed")
    assert result.stats["nodes_per_row_round"] > 2  # more than a chain of k = 2: the leaves were verified
    assert chi_square(counts, expected_joint()) < CHI2_CRITICAL_DF26_ALPHA_0001


def test_rejection_over_trees_whose_leaves_the_rule_chose_has_the_target_joint_distribution(monkeypatch):
    """Under the goodput rule each step brings its own number of leaves (fast.proposals); whatever
    the rule decides from the runner-up probabilities, the walk tests exactly the leaves in the tree.
    Here the rule is replaced by one that gives 0, 1 or 2 leaves by those probabilities."""
    from specbatch.fast import proposals
    counts_seen = []

    def by_probability(runner_ups, reach, worth, calibration, bar):
        count = np.where(runner_ups[:, 0] >= 0.3, 0, (runner_ups >= 0.2).sum(axis=1))
        counts_seen.append(count)
        return count
    monkeypatch.setattr(proposals, "goodput_leaves", by_probability)
    counts, result = sample_joint(tree_branches=3, policy="goodput")
    seen = np.concatenate(counts_seen)
    assert {0, 1, 2} <= set(seen.tolist())  # chains, and trees of both widths, in one run
    assert chi_square(counts, expected_joint()) < CHI2_CRITICAL_DF26_ALPHA_0001


def test_the_rejection_walk_tests_only_the_leaves_a_step_has():
    """Step 0 brought no leaf and step 1 two (the rule's counts): at the root only the spine child
    is a candidate. It is rejected for sure (p gives it nothing), so the row commits a residual draw
    and no path, even though step 1's leaves carry the very token the target wants there."""
    from specbatch.fast.trees import SiblingTrees, rejection_walk
    chooser = sampling.Rejection(1.0, None, None, torch.tensor([3]))
    trees = SiblingTrees.of([2], 3, np.array([10]), np.array([[0, 2]]))
    assert trees.parents[0].tolist() == [-1, 0, 1, 1, 1]
    wanted = 2
    nodes = torch.tensor([[0, 1, 0, wanted, 0]])  # root, d_1 = 1, d_2, then step 1's leaves
    p_nodes = torch.full((1, 5, 3), 1 / 3, dtype=torch.float64)
    p_nodes[0, 0] = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)  # after the root: surely `wanted`
    q = torch.full((1, 2, 3), 1 / 3, dtype=torch.float64)
    for seed in range(20):
        chooser.seeds = torch.tensor([seed])
        choice, accepted, spine, path = rejection_walk(trees, p_nodes, nodes, q, chooser.keys(torch.arange(1)),
                                                       torch.tensor([10]))
        assert accepted.tolist() == [0] and path.tolist() == [[-1, -1]] and choice[0, 0].item() == wanted


@pytest.mark.parametrize("mutant", ["ranked-leaves", "residual-not-updated"])
def test_chi_square_rejects_broken_tree_samplers(monkeypatch, mutant):
    """Leaves that are the draft's next most likely tokens tested as if drawn from q, or a residual
    left as it was after a rejected sibling: both bias the committed tokens."""
    from specbatch.fast import trees
    if mutant == "ranked-leaves":
        monkeypatch.setattr(sampling.Rejection, "siblings", sampling.Chooser.siblings)
    else:
        real = trees.residual_distribution
        calls = {"n": 0}

        def stale_after_the_first(p, q):  # the spine's reject updates p', a rejected leaf's does not
            calls["n"] += 1
            return real(p, q) if calls["n"] % 3 == 1 else p
        monkeypatch.setattr(trees, "residual_distribution", stale_after_the_first)
    counts, _ = sample_joint(tree_branches=3, policy="fixed")
    assert chi_square(counts, expected_joint()) > CHI2_CRITICAL_DF26_ALPHA_0001


def test_a_rejection_tree_with_one_candidate_per_node_is_the_chain_draw_for_draw():
    """rejection_walk over a chain (tree_branches 1) makes Rejection.verify's choices and counts."""
    from specbatch.fast.trees import SiblingTrees, rejection_walk
    rng = np.random.default_rng(4)
    chooser = sampling.Rejection(1.0, None, None, torch.tensor([3, 4, 5, 6]))
    for _ in range(20):
        k, v = 3, 6
        p = torch.tensor(rng.dirichlet(np.ones(v) * 0.5, (4, k + 1)))
        q = torch.tensor(rng.dirichlet(np.ones(v) * 0.5, (4, k)))
        proposed = rng.integers(0, k + 1, 4)
        drafted = torch.tensor(rng.integers(0, v, (4, k)))
        content = torch.tensor(rng.integers(1, 50, 4))
        choice, accepted = chooser.verify(p.log(), drafted, q, torch.as_tensor(proposed), torch.arange(4), content)
        trees = SiblingTrees.of(proposed, 1, content.numpy())
        nodes = torch.cat([torch.zeros(4, 1, dtype=torch.long), drafted], dim=1)[:, :trees.layout.parent.shape[1]]
        p_nodes = p[:, :nodes.shape[1]]
        got, got_accepted, spine, _ = rejection_walk(trees, p_nodes, nodes, q, chooser.keys(torch.arange(4)), content)
        assert got_accepted.tolist() == accepted.tolist() == spine.tolist()
        for i in range(4):
            assert got[i, :accepted[i] + 1].tolist() == choice[i, :accepted[i] + 1].tolist()
