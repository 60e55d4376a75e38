"""The torch engine, every strategy, against transformers' own greedy decoding at batch 1, for
several architectures, drafts, batch sizes, k, budgets, EOS positions and pad ids (I1-I6, S4)."""
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specbatch
from hf_models import ARCHS, EOS, FIXED_K, VOCAB, hf_greedy, oracle, tiny
from specbatch.fast.drafts.scripted import ScriptedDraft
from specbatch.fast.equivalence import compare
from specbatch.invariants import check_trace
from specbatch.reference import RectState, confidence_hashed, deviate_at, deviate_hashed, eqspec_update
from profiles import examples, grid

STRATEGIES = ["eqspec", "exspec", "ragged"]
RNG = np.random.default_rng(0)
# very uneven lengths; EOS (== pad id) inside a prompt; a prompt that is a single token
PROMPTS = [RNG.integers(0, VOCAB, n).tolist() for n in (1, 9, 120, 3, 40, 2)]
PROMPTS[1][3] = EOS
PROMPTS[4][0] = EOS


def eos_mid_generation(model, prompts):
    """EOS ids that the target really emits after a few tokens on some prompt, plus EOS itself."""
    stream = hf_greedy(model, prompts[0], 6, ())
    return [EOS, stream[3]]


def drafts(arch):
    target = tiny(arch)
    return {"none": None, "random": tiny(arch, layers=1, seed=5), "self": target,
            "scripted": ScriptedDraft(target, deviate_hashed(7, 0.35))}


@pytest.mark.parametrize("draft,arch,strategy,mode", grid(draft=["none", "random", "self", "scripted"],
                                                         arch=sorted(ARCHS), strategy=STRATEGIES,
                                                         mode=["fixed", "adaptive"]))
def test_equals_transformers_greedy_float64(arch, draft, strategy, mode):
    """fixed: every row drafts its whole limit; adaptive: the defaults (the goodput policy, priced
    from measured costs), with a scripted confidence so that rows do stop at different steps."""
    target = tiny(arch)
    eos = eos_mid_generation(target, PROMPTS)
    budgets = [12, 1, 9, 16, 5, 12]
    want = oracle(target, PROMPTS, budgets, eos)
    assert any(s[-1] in eos and len(s) < b for s, b in zip(want, budgets)), "EOS should stop some row mid-way"
    chosen = drafts(arch)[draft]
    if mode == "adaptive" and draft == "scripted":
        chosen = ScriptedDraft(target, deviate_hashed(7, 0.35), confidence=confidence_hashed(3))
    result = specbatch.generate(target, chosen, PROMPTS, max_new_tokens=budgets, num_draft_tokens=3,
                                batch_size=4, eos_token_id=eos, check_invariants=(draft == "scripted"),
                                strategy=strategy, **(FIXED_K if mode == "fixed" else {}))
    assert result.sequences == want
    assert result.stop_reasons == ["eos" if s[-1] in eos else "length" for s in want]


@pytest.mark.parametrize("k,batch_size,strategy", grid(k=[1, 2, 5, 8], batch_size=[1, 2, 5, 8], strategy=STRATEGIES))
def test_batch_sizes_and_draft_lengths(batch_size, k, strategy):
    target = tiny("llama")
    want = oracle(target, PROMPTS, 14, [EOS])
    draft = ScriptedDraft(target, deviate_hashed(k, 0.25))
    result = specbatch.generate(target, draft, PROMPTS, max_new_tokens=14, num_draft_tokens=k, batch_size=batch_size,
                                strategy=strategy, **FIXED_K)
    assert result.sequences == want


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_full_acceptance_commits_k_plus_one_tokens_per_round(strategy):
    target = tiny("qwen3")
    prompts = [PROMPTS[3], PROMPTS[5]]
    result = specbatch.generate(target, target, prompts, max_new_tokens=12, num_draft_tokens=3, batch_size=2,
                                eos_token_id=[], strategy=strategy, **FIXED_K)
    assert result.stats["mean_accepted_length"] == 4.0 and result.stats["acceptance_rate"] == 1.0
    if strategy != "exspec":  # exspec may run the two rows (of different lengths) in separate rounds
        assert result.stats["rounds"] == 3
    assert result.sequences == oracle(target, prompts, 12, [])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_budget_ending_mid_round_and_max_new_tokens_one(strategy):
    target = tiny("llama")
    for budget in ([1] * 6, [1, 2, 3, 4, 5, 6], 7):
        want = oracle(target, PROMPTS, budget, [])
        result = specbatch.generate(target, target, PROMPTS, max_new_tokens=budget, num_draft_tokens=4,
                                    batch_size=3, eos_token_id=[], check_invariants=True, strategy=strategy, **FIXED_K)
        assert result.sequences == want
        assert all(r == "length" for r in result.stop_reasons)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pad_id_does_not_matter(strategy):
    target = tiny("gpt2")
    draft = ScriptedDraft(target, deviate_at([4, 11, 12, 30]))
    outs = [specbatch.generate(target, draft, PROMPTS, max_new_tokens=10, num_draft_tokens=4, batch_size=6,
                               pad_token_id=pad, strategy=strategy, **FIXED_K).sequences for pad in (EOS, 0, PROMPTS[2][5])]
    assert outs[0] == outs[1] == outs[2] == oracle(target, PROMPTS, 10, [EOS])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sliding_window_is_applied_by_position(strategy):
    target = tiny("mistral", sliding_window=6)
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[5]]
    want = oracle(target, prompts, 14, [EOS])
    assert want != oracle(tiny("mistral"), prompts, 14, [EOS])  # the window really changes the output
    result = specbatch.generate(target, ScriptedDraft(target, deviate_hashed(2, 0.3)), prompts, max_new_tokens=14,
                                num_draft_tokens=3, batch_size=2, check_invariants=True, strategy=strategy, **FIXED_K)
    assert result.sequences == want


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_attention_soft_capping_is_applied(strategy):
    """Gemma 2's tanh soft-capping of attention scores (and of the final logits), float64 exact."""
    target = tiny("gemma2")
    want = oracle(target, PROMPTS, 12, [EOS])
    assert want != oracle(tiny("gemma2", attn_logit_softcapping=0.9), PROMPTS, 12, [EOS])  # the cap changes the output
    for draft in (tiny("gemma2", layers=1, seed=5), ScriptedDraft(target, deviate_hashed(2, 0.3))):
        result = specbatch.generate(target, draft, PROMPTS, max_new_tokens=12, num_draft_tokens=3, batch_size=4,
                                    eos_token_id=[EOS], check_invariants=True, strategy=strategy, **FIXED_K)
        assert result.sequences == want


def test_work_counters_no_reprefill():
    """Both models keep their caches: each processes about one position per committed token."""
    target = tiny("llama")
    result = specbatch.generate(target, target, PROMPTS, max_new_tokens=16, num_draft_tokens=4, batch_size=6,
                                eos_token_id=[], **FIXED_K)
    stats, rows = result.stats, len(PROMPTS)
    assert stats["generated_tokens"] == 16 * rows and stats["rounds"] == 4
    prefill = sum(len(p) - 1 for p in PROMPTS)  # one packed prefill of the real tokens, then never again
    # rounds commit 5, 5, 5 then 1 token (budget 16): k + 1 verify positions per row, then 1
    assert stats["target_tokens_processed"] == prefill + 3 * rows * 5 + rows * 1
    assert stats["draft_tokens_processed"] <= prefill + 4 * rows * (4 + 1)  # k steps, the first re-feeds <= 2
    assert stats["draft_tokens_processed"] >= prefill + 3 * rows * 4  # the last round (1 token left) drafts nothing


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_float32_matches_or_diverges_only_at_ties(strategy):
    target = tiny("llama", dtype=torch.float32)
    want = oracle(target, PROMPTS, 16, [EOS])
    for draft in (None, target, ScriptedDraft(target, deviate_hashed(3, 0.4))):
        result = specbatch.generate(target, draft, PROMPTS, max_new_tokens=16, num_draft_tokens=4, batch_size=6,
                                    strategy=strategy)
        reports = compare(target, PROMPTS, result.sequences, want, tolerance=1e-3)
        assert all(r["exact"] or r["kind"] == "tie" for r in reports), reports


def replay_with_reference(trace_path):
    """Replay the EQSPEC update of the NumPy reference on each round of a torch trace and require
    the next round's layout (tokens of every row, pad lengths) to be exactly what it predicts."""
    lines = [json.loads(x) for x in open(trace_path)]
    rounds = [x for x in lines if "round" in x]
    for now, nxt in zip(rounds, rounds[1:]):
        rows = [r for r in now["rows"] if not r["finished"]]
        if not rows or [r["request"] for r in rows] != [r["request"] for r in nxt["rows"]]:
            continue  # a new batch started
        state = RectState(np.array([r["tokens"] for r in rows]), np.array([r["content_len"] for r in rows]))
        width = max(len(r["committed"]) for r in rows)
        new = np.array([r["committed"] + [0] * (width - len(r["committed"])) for r in rows])
        predicted, _ = eqspec_update(state, new, np.array([len(r["committed"]) for r in rows]))
        for i, row in enumerate(nxt["rows"]):
            assert row["pad_len"] == predicted.pad_len[i]
            assert row["tokens"][row["pad_len"]:] == predicted.tokens[i, predicted.pad_len[i]:].tolist()


@pytest.mark.parametrize("strategy", STRATEGIES)
@given(deviations=st.sets(st.integers(1, 60), max_size=25), k=st.integers(1, 8), batch=st.integers(1, 6),
       budgets=st.lists(st.integers(1, 14), min_size=6, max_size=6))
@settings(max_examples=examples(12))
def test_fuzzed_acceptance_patterns_against_the_reference(tmp_path_factory, strategy, deviations, k, batch, budgets):
    target = tiny("llama")
    full = oracle(target, PROMPTS, 14, [EOS])
    want = [s[:b] for s, b in zip(full, budgets)]
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    result = specbatch.generate(target, ScriptedDraft(target, deviate_at(deviations)), PROMPTS,
                                max_new_tokens=budgets, num_draft_tokens=k, batch_size=batch,
                                check_invariants=True, trace=path, strategy=strategy, **FIXED_K)
    assert result.sequences == want
    assert check_trace(path) == []
    if strategy == "eqspec":
        replay_with_reference(path)
    elif strategy == "ragged":
        replay_ragged_with_reference(path, batch)


def replay_ragged_with_reference(trace_path, slots):
    """Replay the ragged layout's scheduling and commits with the reference: the SlotQueue decides
    which requests run each round (the batch stays full while requests wait), and every row's
    content grows by exactly its committed tokens (reference.rounds.ragged_commit)."""
    from specbatch.reference import RaggedState, SlotQueue, ragged_commit
    lines = [json.loads(x) for x in open(trace_path)]
    header, rounds = lines[0], [x for x in lines if "round" in x]
    queue = SlotQueue(slots)
    for r in range(header["num_requests"]):
        queue.submit(r)
    state = RaggedState.empty(slots, 512)
    for rnd in rounds:
        for slot, request in queue.refill():
            state.request[slot] = request
            state.content_len[slot] = 0
        running = {int(r): s for s, r in enumerate(queue.owner) if r >= 0}
        assert sorted(row["request"] for row in rnd["rows"]) == sorted(running)
        for row in rnd["rows"]:
            slot = running[row["request"]]
            if state.content_len[slot] == 0:  # newly admitted: its prompt
                content = row["tokens"][:row["content_len"]]
                state.tokens[slot, :len(content)] = content
                state.content_len[slot] = len(content)
            assert state.content(slot) == row["tokens"][:row["content_len"]]
            ragged_commit(state, [slot], [row["committed"]])
            if row["finished"]:
                queue.release(slot)


@pytest.mark.full
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_long_prompts_200_tokens_all_architectures(arch):
    target = tiny(arch)
    prompts = [RNG.integers(0, VOCAB, n).tolist() for n in (200, 1, 77, 150, 5, 33, 120, 2)]
    want = oracle(target, prompts, 24, [EOS])
    for draft in drafts(arch).values():
        for batch in (3, 8):  # batches of mixed lengths, refilled, and all eight at once (batch 1 is a row alone)
            for strategy in STRATEGIES:
                result = specbatch.generate(target, draft, prompts, max_new_tokens=24, num_draft_tokens=5,
                                            batch_size=batch, strategy=strategy)
                assert result.sequences == want


def test_ragged_moves_no_cache_data_and_keeps_the_batch_full():
    """The slot buffers are allocated once and never replaced; while requests wait, every slot runs."""
    from specbatch.fast.engine import Clock, Settings, Stats
    from specbatch.fast.models import ModelRunner, mask_fill_value
    from specbatch.fast.strategies.ragged import RaggedEngine
    target = tiny("llama")
    settings = Settings(k=3, eos_ids=(EOS,), window=None, dtype=torch.float64, device=torch.device("cpu"),
                        fill=mask_fill_value(torch.float64))
    stats = Stats()
    engine = RaggedEngine(ModelRunner(target), ModelRunner(ScriptedDraft(target, deviate_hashed(4, 0.3))), PROMPTS,
                          [3, 9, 5, 12, 2, 7], settings, stats, Clock(stats, settings.device), slots=3)
    done = {}
    engine.admit()
    caches = {"target": engine.cache, "draft": engine.proposer.cache}
    pointers = {name: [layer.keys.data_ptr() for layer in cache.layers] for name, cache in caches.items()}
    rounds = 0
    while engine.queue.queue or (engine.request >= 0).any():
        rounds += 1
        engine.step(rounds, lambda r, tokens, reason, n: done.setdefault(r, tokens))
        if engine.last_round["queued"]:
            assert len(engine.last_round["slots"]) == engine.slots
    assert {name: [layer.keys.data_ptr() for layer in cache.layers] for name, cache in caches.items()} == pointers
    assert [done[r] for r in range(len(PROMPTS))] == oracle(target, PROMPTS, [3, 9, 5, 12, 2, 7], [EOS])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_requests_arriving_over_time_are_served_after_they_arrive(strategy):
    target = tiny("llama")
    arrivals = [0.0, 0.0, 0.05, 0.1, 0.2, 0.2]
    result = specbatch.generate(target, ScriptedDraft(target, deviate_hashed(5, 0.3)), PROMPTS, max_new_tokens=6,
                                num_draft_tokens=3, batch_size=2, strategy=strategy, arrivals=arrivals,
                                check_invariants=True)
    assert result.sequences == oracle(target, PROMPTS, 6, [EOS])
    assert all(r["latency"] > 0 for r in result.request_stats)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_acceptance_by_draft_position_matches_the_trace(strategy, tmp_path):
    """stats' proposed/accepted_by_position count, at each draft position j, the rows that proposed
    (and accepted) a j-th token, as the trace's draft_limit and accepted say; mean_accepted_length
    counts the bonus token."""
    target = tiny("llama")
    trace = tmp_path / "t.jsonl"
    result = specbatch.generate(target, ScriptedDraft(target, deviate_hashed(3, 0.3)), PROMPTS, max_new_tokens=10,
                                num_draft_tokens=4, batch_size=3, strategy=strategy, trace=str(trace), **FIXED_K)
    proposed, accepted, rows = np.zeros(4, dtype=int), np.zeros(4, dtype=int), 0
    for line in trace.read_text().splitlines()[1:]:
        for row in json.loads(line).get("rows", []):
            proposed[:row["draft_limit"]] += 1
            accepted[:row["accepted"]] += 1
            rows += 1
    s = result.stats
    assert s["proposed_by_position"] == proposed.tolist() and s["accepted_by_position"] == accepted.tolist()
    assert sum(s["accepted_by_position"]) == s["accepted_tokens"] and 0 < s["accepted_tokens"] < s["drafted_tokens"]
    assert s["acceptance_rate_by_position"] == pytest.approx((accepted / proposed).tolist())
    assert s["mean_accepted_length"] == pytest.approx(s["generated_tokens"] / rows)
