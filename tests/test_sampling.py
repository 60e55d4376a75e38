"""Sampling: the exact target distribution (rejection mode), token identity with target-only
sampling (coupled mode), keyed randomness (S4), and statistical tests with the power to reject
plausible bugs."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import specbatch
import specbatch.fast.sampling as sampling
from hf_models import EOS, tiny
from specbatch.fast.drafts import ScriptedDraft
from specbatch.fast.models import WeightlessLM
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
P_TABLE = np.array([[[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]],
                    [[0.1, 0.7, 0.2], [0.5, 0.1, 0.4], [0.25, 0.25, 0.5]],
                    [[0.4, 0.4, 0.2], [0.2, 0.2, 0.6], [0.7, 0.2, 0.1]]])
Q_TABLE = np.array([[[0.1, 0.2, 0.7], [0.6, 0.2, 0.2], [0.3, 0.6, 0.1]],
                    [[0.5, 0.1, 0.4], [0.2, 0.2, 0.6], [0.6, 0.3, 0.1]],
                    [[0.1, 0.1, 0.8], [0.5, 0.4, 0.1], [0.2, 0.6, 0.2]]])


class ImposedLM(WeightlessLM):
    """A "model" whose next-token distribution is table[position, token]; it keeps a dummy cache
    entry per token so the engine's cache bookkeeping runs as for a real model."""

    def __init__(self, table):
        super().__init__(VOCAB3, "imposed")
        self.register_buffer("log_table", torch.tensor(table).log())

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, cache=None, logits_to_keep=0, **kw):
        dummy = torch.zeros(input_ids.shape[0], 1, input_ids.shape[1], 1, dtype=torch.float64)
        cache.update(dummy, dummy, 0)
        logits = self.log_table[position_ids.clamp(max=2), input_ids]
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


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


def sample_joint(strategy="ragged", seed=0):
    prompts = [[0]] * SAMPLES  # every request id gives its own keyed randomness
    result = specbatch.generate(ImposedLM(P_TABLE), ImposedLM(Q_TABLE), prompts, max_new_tokens=3,
                                num_draft_tokens=2, batch_size=4000, strategy=strategy, temperature=1.0,
                                seed=seed, eos_token_id=[])
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
