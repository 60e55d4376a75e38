"""Scheduling: the reference's schedulers against independent statements of their rules, and the
torch engine's scheduling decisions against the reference (reference.pool states what the fast
engine runs: EQSPEC's fixed batches, the EXSPEC pool, the ragged slot queue)."""
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import specbatch
from hf_models import FIXED_K, tiny
from specbatch.fast.drafts.scripted import ScriptedDraft
from specbatch.fast.strategies import eqspec as fast_eqspec
from specbatch.reference import ExspecPool, FixedBatches, deviate_hashed


@given(count=st.integers(1, 30), batch=st.integers(1, 8), seed=st.integers(0, 10**6))
def test_fixed_batches_are_consecutive_chunks_that_never_refill(count, batch, seed):
    """Stated independently: batch j holds requests j*B .. j*B+B-1 (arrival order), and no request
    of batch j+1 runs before every request of batch j has finished."""
    rng = np.random.default_rng(seed)
    life = rng.integers(1, 6, count)  # rounds each request runs
    sched = FixedBatches(batch)
    for r in range(count):
        sched.submit(r)
    started, finished_at, rnd = {}, {}, 0
    while sched.queue or sched.running:
        for r in sched.next_batch():
            started[r] = rnd
        assert sched.running, "a round with an empty batch"
        rnd += 1
        done = [r for r in sched.running if rnd - started[r] >= life[r]]
        for r in done:
            finished_at[r] = rnd
        sched.finish(done)
    chunks = [list(range(j, min(j + batch, count))) for j in range(0, count, batch)]
    for j, chunk in enumerate(chunks):
        assert len({started[r] for r in chunk}) == 1  # the chunk starts together
        if j:
            assert started[chunk[0]] == max(finished_at[r] for r in chunks[j - 1])  # only after the last ended
    assert sorted(sched.done) == list(range(count))


def trace_rounds(path):
    lines = [json.loads(x) for x in open(path)]
    return lines[0], [x for x in lines if "round" in x]


@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=9), budgets=st.data(), batch=st.integers(1, 4))
def test_fast_eqspec_runs_the_reference_fixed_batches(tmp_path_factory, lengths, budgets, batch):
    target = tiny("llama")
    rng = np.random.default_rng(len(lengths) * 31 + batch)
    prompts = [rng.integers(3, 90, n).tolist() for n in lengths]
    max_new = budgets.draw(st.lists(st.integers(1, 9), min_size=len(prompts), max_size=len(prompts)))
    path = tmp_path_factory.mktemp("t") / "t.jsonl"
    specbatch.generate(target, ScriptedDraft(target, deviate_hashed(2, 0.4)), prompts, max_new_tokens=max_new,
                       batch_size=batch, strategy="eqspec", trace=path, eos_token_id=[], **FIXED_K)
    _, rounds = trace_rounds(path)
    sched = FixedBatches(batch)
    for r in range(len(prompts)):
        sched.submit(r)
    for rnd in rounds:
        sched.next_batch()
        assert sorted(row["request"] for row in rnd["rows"]) == sorted(sched.running)
        sched.finish([row["request"] for row in rnd["rows"] if row["finished"]])
    assert not sched.queue and not sched.running


@given(lengths=st.lists(st.integers(1, 8), min_size=1, max_size=10), budgets=st.data(), batch=st.integers(1, 4),
       max_wait=st.integers(0, 3))
def test_fast_exspec_decisions_replay_on_the_reference_pool(tmp_path_factory, lengths, budgets, batch, max_wait):
    """Target-only (keys are lengths alone): every round runs exactly the rows the reference pool
    selects from the trace's lengths, and the reported grouped / fallback counts are the pool's."""
    target = tiny("llama")
    rng = np.random.default_rng(len(lengths) * 7 + batch)
    prompts = [rng.integers(3, 90, n).tolist() for n in lengths]
    max_new = budgets.draw(st.lists(st.integers(1, 6), min_size=len(prompts), max_size=len(prompts)))
    path = tmp_path_factory.mktemp("t") / "t.jsonl"
    result = specbatch.generate(target, None, prompts, max_new_tokens=max_new, batch_size=batch, strategy="exspec",
                                max_wait=max_wait, trace=path, eos_token_id=[])
    _, rounds = trace_rounds(path)
    pool = ExspecPool(batch, window=4 * batch, max_wait=max_wait)
    for r in range(len(prompts)):
        pool.submit(r)
    grouped_rounds = 0
    for rnd in rounds:
        for r in pool.admit():
            pool.enter(r, (len(prompts[r]), 1, 1))
        chosen, grouped = pool.select()
        grouped_rounds += grouped
        assert sorted(row["request"] for row in rnd["rows"]) == sorted(chosen)
        keys = {row["request"]: (row["content_len"] + len(row["committed"]), 1, 1) for row in rnd["rows"]}
        pool.finish_round(keys, {row["request"] for row in rnd["rows"] if row["finished"]})
    assert result.stats["grouped_rounds"] == grouped_rounds
    assert result.stats["fallback_rounds"] == len(rounds) - grouped_rounds


def record_exspec_rounds(monkeypatch):
    """[(grouped, content lengths of the batch that ran)] for every exspec round."""
    import specbatch.fast.strategies.exspec as fast_exspec
    log = []
    select = ExspecPool.select

    def logged_select(self):
        chosen, grouped = select(self)
        log.append([grouped])
        return chosen, grouped
    run_round = fast_eqspec.RectBatch.round

    def logged_round(self, index):
        log[-1].append(sorted(int(c) for c in self.content_len))
        return run_round(self, index)
    monkeypatch.setattr(fast_exspec.ExspecPool, "select", logged_select)
    monkeypatch.setattr(fast_eqspec.RectBatch, "round", logged_round)
    return log


@pytest.mark.parametrize("lengths,grouped,fallback", [
    ([3, 3, 4, 6], 3, 3),  # A,B equal for 3 rounds, then C and D (4 vs 6) fall back together
    ([4, 5, 8, 11], 0, 6),  # no two rows ever share a length
])
def test_exspec_grouping_by_hand(monkeypatch, lengths, grouped, fallback):
    """Batch 2, 3 new tokens each, target only: the counts computed by hand from the pool's rules
    (README, reference/pool.py), and every grouped round really ran rows of one length."""
    log = record_exspec_rounds(monkeypatch)
    prompts = [list(range(5, 5 + n)) for n in lengths]
    result = specbatch.generate(tiny("llama"), None, prompts, max_new_tokens=3, batch_size=2, strategy="exspec",
                                eos_token_id=[])
    assert (result.stats["grouped_rounds"], result.stats["fallback_rounds"]) == (grouped, fallback)
    for was_grouped, lens in log:
        assert not was_grouped or len(set(lens)) == 1, log


@pytest.mark.parametrize("seed", range(3))
def test_exspec_grouped_rounds_have_equal_lengths_with_drafts(monkeypatch, seed):
    log = record_exspec_rounds(monkeypatch)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 90, int(n)).tolist() for n in rng.integers(1, 6, 10)]
    target = tiny("llama")
    specbatch.generate(target, ScriptedDraft(target, deviate_hashed(seed, 0.4)), prompts, max_new_tokens=8,
                       batch_size=3, strategy="exspec", eos_token_id=[], **FIXED_K)
    assert any(g for g, _ in log) and not all(g for g, _ in log)  # both kinds happened
    for was_grouped, lens in log:
        assert not was_grouped or len(set(lens)) == 1, log
