"""Sampled vectors with logit processors: the checker recomputes the processed distribution after
every sampled prefix (penalties depend on it, min_tokens on its length), exact samplers pass, and a
sampler that applies processors to the bonus token only, ignores the drafts in its penalties, holds
EOS back one token too briefly or reuses the draft's uniform for acceptance is rejected."""
import json

import numpy as np
import pytest
import torch

from hf_models import tiny
from specbatch.reference.processors import Processors, process_logits, sampling_distribution
from specbatch.conformance.sampled import (PROCESSOR_KEYS, _processed, check_samples, processor_kwargs, reference_probs,
                               sampled_vectors, setting_processors, without_settings)
from specbatch.conformance.sampling_engines import BUGS, PROCESSOR_BUGS, _process, sampling_engine
from specbatch.conformance.testing import (ConformanceError, check_sampling, expressible, hf_sampling_engine, run_sampled,
                               specbatch_sampling_engine, toy_sampling_pair)

TOY = toy_sampling_pair()


def test_reference_probs_with_min_p_are_the_reference_sampling_distribution():
    logits = torch.randn(30, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    for temperature, top_k, min_p in ((1.0, None, 0.1), (0.7, 20, 0.05), (1.3, 5, 0.3)):
        got = reference_probs(logits, temperature, top_k, None, min_p=min_p).numpy()
        want = np.stack([sampling_distribution(row, temperature, top_k, None, min_p) for row in logits.numpy()])
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
        assert ((got > 0) == (want > 0)).all()


def test_the_checker_processes_each_row_from_its_own_prefix():
    """_processed: row n of the flat logits is processed with its sequence's prompt and the tokens of
    its continuation before it (a bug that used the whole continuation, or none, differs)."""
    gen = torch.Generator().manual_seed(1)
    prompts, conts = [[1, 2, 3], [4, 4]], [[5, 1, 5], [2, 6]]
    flat = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    setting = dict(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=0.3, min_tokens=2,
                   logit_bias={"3": 1.5})
    got = _processed(flat, setting, prompts, conts, [7]).numpy()
    proc = Processors(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=0.3, min_tokens=2,
                      logit_bias={3: 1.5})
    n = 0
    for prompt, cont in zip(prompts, conts):
        for t in range(len(cont)):
            np.testing.assert_array_equal(got[n], process_logits(flat[n].numpy(), prompt, cont[:t], proc, [7]))
            n += 1
    assert np.isneginf(got[[0, 1, 3, 4], 7]).all() and np.isfinite(got[2, 7])  # min_tokens: rows at t < 2
    assert setting_processors(setting).logit_bias == {3: 1.5}  # JSON's string keys back to ids


def test_the_textbook_sampler_processes_like_the_reference():
    """sampling_engines._process (vectorized over rows and queries, drafts in the prefix) equals
    process_logits query by query."""
    gen = torch.Generator().manual_seed(2)
    work = torch.randint(0, 9, (3, 12), generator=gen)
    prompt_len, first = torch.tensor([2, 4, 3]), torch.tensor([5, 4, 7])
    logits = torch.randn(3, 4, 9, generator=gen, dtype=torch.float64)
    proc = Processors(repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.2, min_tokens=3,
                      logit_bias={1: -2.0, 4: 0.5})
    got = _process(logits, work, prompt_len, first, proc, torch.tensor([8]), None)
    for r in range(3):
        for j in range(4):
            prefix = work[r, :int(first[r]) + j].tolist()
            want = process_logits(logits[r, j].numpy(), prefix[:int(prompt_len[r])], prefix[int(prompt_len[r]):],
                                  proc, [8])
            np.testing.assert_allclose(got[r, j].numpy(), want, rtol=1e-12)


def test_processor_settings_are_stored_with_every_row_and_survive_json():
    target, _ = TOY
    vectors = sampled_vectors(target, samples=8, processors=True)
    names = [s["name"] for s in vectors.settings()]
    assert names == ["t1.0-rep1.5", "t0.8-freq1-pres0.5", "t1.0-minp0.1", "t0.7-k20-minp0.05", "t1.0-bias",
                     "t1.0-min-tokens3"]
    assert {k for s in vectors.settings() for k in processor_kwargs(s)} == set(PROCESSOR_KEYS)
    assert not any(s["top_p"] for s in vectors.settings() if s.get("min_p"))  # min_p never beside top-p
    for s in json.loads(json.dumps(vectors.manifest))["settings"]:  # as a file holds them
        assert processor_kwargs(s) == processor_kwargs(next(t for t in vectors.settings() if t["name"] == s["name"]))
    row = vectors.rows_of("t1.0-min-tokens3")[0]
    assert row["min_tokens"] == 3 and list(row["logit_bias"]) == [63]
    kept, left_out = without_settings(vectors, "presence_penalty,min_p")
    assert left_out == ["t0.8-freq1-pres0.5", "t1.0-minp0.1", "t0.7-k20-minp0.05"]
    assert {r["setting"] for r in kept.rows} == {"t1.0-rep1.5", "t1.0-bias", "t1.0-min-tokens3"}


def test_exact_samplers_with_processors_pass():
    target, draft = TOY
    vectors = sampled_vectors(target, seed=7, processors=True)
    for engine in (sampling_engine(target, None), sampling_engine(target, draft)):
        report = check_samples(vectors, run_sampled(engine, vectors), target)
        assert report.conformant, report.table()
        assert len(report.settings) == 6 and not report.violations


PROCESSOR_FLAGGED_BY = {  # the part that must reject each bug at the default size (one run)
    "processors-bonus-only": "tree", "penalties-drafts-ignored": "tree", "min-tokens-off-by-one": "support",
    "draft-noise-reused": "tree",
}


@pytest.mark.parametrize("bug", sorted(PROCESSOR_FLAGGED_BY))
def test_each_processor_bug_is_flagged_by_its_part(bug):
    target, draft = TOY
    vectors = sampled_vectors(target, seed=8, processors=bug in PROCESSOR_BUGS)
    report = check_samples(vectors, run_sampled(sampling_engine(target, draft, bug=bug), vectors), target)
    assert not report.conformant
    if PROCESSOR_FLAGGED_BY[bug] == "support":  # an EOS at new token 2, which min_tokens 3 forbids
        assert {(row.split("/")[0], position) for row, position, _ in report.violations} == {("t1.0-min-tokens3", 2)}
    else:
        assert min(p for name, p in report.p_values() if "tree" in name) < report.threshold, report.table()


def test_every_sampled_bug_is_named_with_its_part():
    from test_sampled import FLAGGED_BY
    assert set(FLAGGED_BY) | set(PROCESSOR_FLAGGED_BY) | {"draft-bf16-logits"} == set(BUGS)
    assert set(PROCESSOR_BUGS) < set(PROCESSOR_FLAGGED_BY)


@pytest.mark.parametrize("sampling", ["rejection", "coupled"])
def test_specbatch_with_processors_passes_on_a_tiny_model(sampling):
    target = tiny("llama", seed=0, dtype=torch.float32)
    draft = tiny("llama", layers=1, seed=1, dtype=torch.float32)
    vectors = sampled_vectors(target, seed=4, samples=32, processors=True)
    report = check_sampling(specbatch_sampling_engine(target, draft, sampling), vectors, target, batch_size=8)
    assert report.conformant and not report.violations and len(report.settings) == len(vectors.settings())


def test_specbatch_with_processors_at_draft_positions_skipped_is_rejected():
    """The fast engine with processors at its last verify query only (testing.PROCESSOR_BUGS'
    bonus-only), on a tiny model made peaked (random weights give near-uniform distributions, where
    a logit bias moves little mass), with the logit-bias setting."""
    from specbatch.conformance.testing import broken_processor_sampling_engine
    target = tiny("llama", seed=0, dtype=torch.float32)
    with torch.no_grad():
        target.lm_head.weight.mul_(30.0)
    vectors = sampled_vectors(target, seed=4, samples=128, processors=True).subset(settings=["t1.0-bias"])
    assert check_sampling(specbatch_sampling_engine(target, target), vectors, target, batch_size=8).conformant
    with pytest.raises(ConformanceError, match="t1.0-bias tree"):
        check_sampling(broken_processor_sampling_engine(target, target, "bonus-only"), vectors, target, batch_size=8)


def test_an_engine_is_judged_on_the_settings_it_can_express():
    target, _ = TOY
    vectors = sampled_vectors(target, samples=8, processors=True)
    engine = hf_sampling_engine(target)
    kept, left_out = expressible(vectors, engine)
    assert left_out == ["t0.8-freq1-pres0.5"] and len(kept.settings()) == 5
    assert expressible(vectors, sampling_engine(target))[1] == []  # no SUPPORTS: it takes every setting
