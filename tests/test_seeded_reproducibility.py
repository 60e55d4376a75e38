"""Seeded reproducibility, a verdict of its own (specbatch.conformance.testing.check_seeded_reproducibility): a
request with its own seed gives the same tokens alone, in a batch, in another order and, in coupled
mode, with speculation off; engines whose randomness follows the batch are told apart."""
import numpy as np
import pytest

from hf_models import EOS, tiny
from profiles import only_full
from specbatch import testing
from specbatch.fast.drafts.scripted import ScriptedDraft
from specbatch.reference import deviate_hashed
from specbatch.conformance.sampling_engines import sampling_engine

PROMPTS = [np.random.default_rng(0).integers(0, 96, n).tolist() for n in (3, 9, 5, 12)]


def kinds(report):
    return sorted({d[1] for d in report["differences"]})


@pytest.mark.parametrize("strategy", only_full("ragged", "eqspec", "exspec"))
def test_specbatch_coupled_is_reproducible_alone_in_a_batch_and_without_speculation(strategy):
    target = tiny("llama")
    draft = ScriptedDraft(target, deviate_hashed(7, 0.35))
    on = testing.specbatch_sampling_engine(target, draft, "coupled", strategy, policy="fixed")
    off = testing.specbatch_sampling_engine(target, None, "coupled", strategy)
    report = testing.check_seeded_reproducibility(on, PROMPTS, batch_size=3, eos_token_ids=[EOS], speculation_off=off)
    assert report["reproducible"], report["differences"][:2]


def test_specbatch_rejection_is_reproducible_across_batches_not_across_speculation():
    """Rejection mode keeps the distribution, not the tokens, when speculation is switched off."""
    target = tiny("llama")
    on = testing.specbatch_sampling_engine(target, ScriptedDraft(target, deviate_hashed(7, 0.35)), "rejection",
                                           policy="fixed")
    off = testing.specbatch_sampling_engine(target, None, "rejection")
    report = testing.check_seeded_reproducibility(on, PROMPTS, batch_size=3, eos_token_ids=[EOS], speculation_off=off)
    assert kinds(report) == ["speculation off"]


@pytest.mark.parametrize("bug", ["shared-stream", "slot-keyed"])
def test_randomness_tied_to_the_batch_is_flagged(bug):
    target = tiny("llama")
    engine = testing.broken_sampling_engine(target, tiny("llama", layers=1, seed=5), bug)
    correct = sampling_engine(target, tiny("llama", layers=1, seed=5))
    assert testing.check_seeded_reproducibility(correct, PROMPTS, batch_size=3, eos_token_ids=[EOS])["reproducible"]
    report = testing.check_seeded_reproducibility(engine, PROMPTS, batch_size=3, eos_token_ids=[EOS])
    assert not report["reproducible"] and "alone" in kinds(report)


def test_transformers_batched_sampling_promises_no_per_request_seed():
    report = testing.check_seeded_reproducibility(testing.hf_sampling_engine(tiny("llama")), PROMPTS, batch_size=3,
                                                  eos_token_ids=[EOS])
    assert not report["reproducible"]
