"""Packed prefill (fast.compute.prefill) and length-grouped attention (fast.compute.attention): the K/V they leave in
the caches equal unpadded batch-1 prefills (I3), packs keep prompts apart (I2, I4), grouping reads
every row's whole visible range, and generation through them equals transformers' greedy decoding
with prompts of 1 to 700 tokens mixed in one admission, pad == EOS and pad ids inside prompts."""
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import specbatch
from hf_models import EOS, FIXED_K, VOCAB, oracle, tiny
from specbatch.fast.compute import prefill as prefill_module
from specbatch.fast.compute.attention import (Plan, current_plan, forward_plan, grouped_attention, plain_attention, plan_groups,
                                      plan_parts, scoped_plan)
from specbatch.fast.engine import Settings, fresh_kv
from specbatch.fast.models import ModelRunner, mask_fill_value
from specbatch.fast.observer import InvariantChecker
from specbatch.fast.compute.prefill import packed_inputs, plan_packs, prefill_into, prefill_rectangle
from specbatch.fast.compute.slot_cache import SlotCache
from specbatch.invariants import check_packed_forward

RNG = np.random.default_rng(11)
LENGTHS = (1, 700, 3, 64, 2, 129, 1, 17)
LONG = [RNG.integers(0, VOCAB, n).tolist() for n in LENGTHS]
LONG[3][5] = LONG[5][0] = EOS  # the pad id (== EOS) inside prompts


def long_target():
    return tiny("llama", max_position_embeddings=1024)


def settings_for(model):
    return Settings(k=0, eos_ids=(EOS,), window=None, dtype=torch.float64, device=torch.device("cpu"),
                    fill=mask_fill_value(torch.float64))


@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(1, 64))
def test_packs_hold_every_prompt_once_in_order_within_the_budget(lengths, budget):
    packs = plan_packs(lengths, budget)
    flat = [i for pack in packs for i in pack]
    assert flat == [i for i, n in enumerate(lengths) if n > 0]  # every non-empty prompt once, in order
    for pack in packs:
        assert len(pack) == 1 or sum(lengths[i] for i in pack) <= budget  # a longer prompt goes alone


@pytest.mark.parametrize("budget", [512, 40])
def test_packed_prefill_leaves_the_kv_of_unpadded_prefills(monkeypatch, budget):
    """Content j of every row sits in its slot j with the K/V of a fresh batch-1 prefill (I3)."""
    monkeypatch.setattr(prefill_module, "PACK_TOKENS", budget)
    model = long_target()
    runner, settings = ModelRunner(model), settings_for(model)
    contents = [p[:-1] for p in LONG]
    forwards, forward = [], ModelRunner.__call__
    monkeypatch.setattr(ModelRunner, "__call__", lambda self, ids, *a, **k: forwards.append(ids.shape[1]) or
                        forward(self, ids, *a, **k))
    slots = [5, 0, 3, 7, 1, 2, 6, 4]  # rows land in arbitrary slots
    cache = SlotCache(runner.num_layers, 8, 720, settings.device)
    settings.observer = checker = InvariantChecker()
    prefill_into(runner, cache, contents, slots, [0] * len(contents), settings)
    assert checker.found == []
    assert runner.tokens_processed == sum(len(c) for c in contents)  # real tokens only
    # one forward per pack of the budget in force (a longer prompt alone)
    assert forwards == [sum(len(contents[i]) for i in pack) for pack in plan_packs([len(c) for c in contents], budget)]
    for content, slot in zip(contents, slots):
        if not content:
            continue
        for layer, (keys, values) in enumerate(fresh_kv(runner, content, settings)):
            got_k, got_v = cache.slot_values(layer, slot, len(content))
            torch.testing.assert_close(got_k, keys, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(got_v, values, rtol=1e-10, atol=1e-12)


def test_rectangular_prefill_right_aligns_each_row():
    model = long_target()
    runner, settings = ModelRunner(model), settings_for(model)
    contents = [p[:-1] for p in LONG]
    width = max(len(c) for c in contents)
    cache = prefill_rectangle(runner, contents, width, settings)
    for row, content in enumerate(contents):
        if not content:
            continue
        pad = width - len(content)
        for layer, (keys, values) in enumerate(fresh_kv(runner, content, settings)):
            got = cache.layers[layer].keys[row, :, pad:].transpose(0, 1)
            torch.testing.assert_close(got, keys, rtol=1e-10, atol=1e-12)


def test_a_pack_that_leaks_across_prompts_or_shifts_positions_is_caught():
    contents = [[4, 5, 6], [7, 8], [9]]
    ids, pos, mask, segment = packed_inputs(contents, None, torch.float64, -1e30, "cpu")
    assert check_packed_forward(pos, mask, [3, 2, 1]) == []
    leaky = mask.clone()
    leaky[0, 0, 3, 2] = 0  # prompt 1's first token sees prompt 0's last token
    found = check_packed_forward(pos, leaky, [3, 2, 1])
    assert [v.invariant for v in found] == ["I4"] and found[0].row == 1
    shifted = pos.clone()
    shifted[0, 3:5] += 3  # prompt 1 continues prompt 0's positions instead of restarting at 0
    assert {v.invariant for v in check_packed_forward(shifted, mask, [3, 2, 1])} == {"I2"}
    windowed = packed_inputs(contents, 2, torch.float64, -1e30, "cpu")[2]
    assert check_packed_forward(pos, windowed, [3, 2, 1], window=2) == []
    assert check_packed_forward(pos, mask, [3, 2, 1], window=2)  # the window hides content 0 from query 2


@given(st.lists(st.integers(1, 300), min_size=1, max_size=20))
def test_groups_cover_every_row_once_and_read_its_whole_range(lengths):
    kv_lens = np.array(lengths)
    groups = plan_groups(kv_lens)
    rows = np.concatenate([r for r, _ in groups])
    assert sorted(rows.tolist()) == list(range(len(lengths)))
    for members, length in groups:
        assert length >= kv_lens[members].max()  # no row is cut short
        assert length == kv_lens[members].max()  # and no group reads past its longest row
    assert len(groups) <= 4
    covered = []
    for rows, length in plan_parts(groups):
        members = np.arange(len(lengths))[rows] if isinstance(rows, slice) else rows
        covered += list(members)
        assert length >= kv_lens[members].max()
    assert sorted(covered) == list(range(len(lengths)))  # the parts split the groups, nothing lost


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_grouped_attention_equals_attention_over_the_longest_row(dtype):
    torch.manual_seed(0)
    batch, heads, kv_heads, queries, dim, slots = 7, 6, 2, 3, 8, 90
    kv_lens = np.array([5, 90, 12, 7, 60, 5, 33])
    q = torch.randn(batch, heads, queries, dim, dtype=dtype)
    k, v = torch.randn(batch, kv_heads, slots, dim, dtype=dtype), torch.randn(batch, kv_heads, slots, dim, dtype=dtype)
    slot = torch.arange(slots)[None, None, :]
    query_index = torch.as_tensor(kv_lens)[:, None] - queries + torch.arange(queries)[None, :]
    visible = slot <= query_index[:, :, None]
    mask = torch.zeros(batch, queries, slots, dtype=dtype).masked_fill_(~visible, -1e30)[:, None]
    want = plain_attention(q, k, v, mask, dim ** -0.5)
    with forward_plan(kv_lens, "cpu"):
        assert len(current_plan().parts) > 1
        got = grouped_attention(q, k, v, mask, dim ** -0.5)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    expanded_k, expanded_v = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)  # GQA by copying
    reference = torch.nn.functional.scaled_dot_product_attention(q.double(), expanded_k.double(), expanded_v.double(),
                                                                 attn_mask=mask.double())
    torch.testing.assert_close(got.double(), reference, **tol)


def test_a_group_read_cut_short_changes_the_output():
    """Mutation check: if a group read only up to its shortest row, some row would lose slots."""
    torch.manual_seed(1)
    kv_lens = np.array([4, 40, 41])
    q, k, v = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 41, 4), torch.randn(3, 2, 41, 4)
    visible = torch.arange(41)[None, None, :] < torch.as_tensor(kv_lens)[:, None, None]
    mask = torch.zeros(3, 1, 41).masked_fill_(~visible, -1e30)[:, None]
    want = plain_attention(q, k, v, mask, 0.5)
    short = [(torch.as_tensor(r), int(kv_lens[r].min())) for r, _ in plan_groups(kv_lens)]
    with scoped_plan(Plan(parts=short)):
        assert not torch.allclose(grouped_attention(q, k, v, mask, 0.5), want)
    assert current_plan() == Plan()  # the plan ends with its block


@pytest.mark.parametrize("strategy,native", [("ragged", True), ("ragged", False), ("eqspec", True),
                                             ("exspec", True)])
def test_prompts_of_1_to_700_tokens_in_one_admission(strategy, native):
    """native=False: the ragged verify's flat attention in Python (the lean Llama target's blocks
    otherwise run in C++, fast.compute.native)."""
    target = long_target()
    want = oracle(target, LONG, 6, [EOS])
    draft = tiny("llama", layers=1, seed=3, max_position_embeddings=1024)
    result = specbatch.generate(target, draft, LONG, max_new_tokens=6, num_draft_tokens=3, batch_size=len(LONG),
                                strategy=strategy, pad_token_id=EOS, check_invariants=True, native=native, **FIXED_K)
    assert result.sequences == want
    assert result.stats["target_tokens_processed"] < sum(LENGTHS) + len(LONG) * 6 * 4  # no padded rectangle


def test_two_engines_interleaved_keep_their_own_attention_plans():
    """The attention plan is scoped to its forward: a generation run inside another one's forward (from
    a layer hook, between two layers) and one on another thread neither see nor clobber the outer
    forward's plan (a flat ragged verify outside, length-grouped rectangles inside); both stay exact."""
    import threading
    outer, inner = tiny("qwen3"), tiny("gpt2", seed=4)
    prompts = [LONG[i] for i in (0, 2, 3, 6, 7)]
    inner_prompts = [p[:9] for p in prompts]
    inner_want = oracle(inner, inner_prompts, 5, [EOS])
    inner_runs, calls = [], []

    def run_inner(module, args, output):
        calls.append(1)
        if len(calls) in (3, 7):  # verifies of the outer ragged engine, between its two layers
            inner_runs.append(specbatch.generate(inner, tiny("gpt2", layers=1, seed=5), inner_prompts,
                                                 max_new_tokens=5, num_draft_tokens=2, batch_size=3,
                                                 strategy="eqspec").sequences)

    hook = outer.model.layers[0].register_forward_hook(run_inner)
    try:
        got = specbatch.generate(outer, tiny("qwen3", layers=1, seed=6), prompts, max_new_tokens=8,
                                 num_draft_tokens=3, batch_size=4, strategy="ragged", **FIXED_K).sequences
    finally:
        hook.remove()
    assert got == oracle(outer, prompts, 8, [EOS])
    assert inner_runs == [inner_want, inner_want]
    threads = [threading.Thread(target=lambda: inner_runs.append(specbatch.generate(
        inner, None, inner_prompts, max_new_tokens=5, batch_size=2, strategy=s).sequences)) for s in ("ragged", "eqspec")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert inner_runs[2:] == [inner_want, inner_want] and current_plan() == Plan()


def test_the_price_of_a_part_decides_how_many_groups_and_slices():
    """plan_groups and plan_parts split only where the slots saved cost more than the calls added."""
    kv_lens = np.array([5, 300, 6, 290, 7])
    assert len(plan_groups(kv_lens, group_cost=100.0)) == 2  # calls cheap: short rows apart from long ones
    assert len(plan_groups(kv_lens, group_cost=1.0)) == 4  # calls nearly free: as many groups as allowed
    assert len(plan_groups(kv_lens, group_cost=1e6)) == 1  # calls dear: one group over the longest row
    scattered = [(np.array([0, 2, 4]), 7)]  # rows 0, 2, 4: three runs of one row
    assert len(plan_parts(scattered, group_cost=1.0)) == 3  # slices: no copy
    assert len(plan_parts(scattered, group_cost=1e6)) == 1 and not isinstance(plan_parts(scattered, 1e6)[0][0], slice)


def test_the_fitted_price_of_a_part_is_the_call_over_the_slot():
    from specbatch.fast.compute.attention_cost import fit_group_cost
    points = [(x, 50e-6 + 100e-9 * x) for x in (32, 512, 2048, 8000)]  # 50 µs a call, 100 ns a row-slot
    assert fit_group_cost(points) == pytest.approx(500.0)
    assert fit_group_cost([(32, 1e-5), (8000, 1e-5)]) == 8000  # slots free: as dear as the largest part
    assert fit_group_cost([(32, 0.0), (8000, 1e-3)]) == 1.0  # calls free: at least one slot


def test_engine_attention_measures_the_price_of_a_part_for_the_target():
    from specbatch.fast.compute import attention_cost
    from specbatch.fast.compute.attention import GROUP_COST, engine_attention
    target = tiny("llama", dtype=torch.float32)
    config = target.config
    with engine_attention(target, None):
        cost = current_plan().group_cost
    heads = config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    sdpa, measured = attention_cost.pricing(heads, config.num_key_value_heads, dim, torch.float32, "cpu")
    assert cost == measured and current_plan() == Plan()
    with engine_attention(target, None):
        assert current_plan().sdpa == sdpa  # the kernel measured faster computes the parts
    assert 1.0 <= cost <= max(rows * length for rows, length in attention_cost.SHAPES)
    with engine_attention(target, None, fused=True):
        assert current_plan().group_cost == GROUP_COST  # one group anyway
    assert current_plan() == Plan()


@pytest.mark.parametrize("cost, parts", [(1.0, 3), (1e6, 1)])  # cheap: rows 0 and 2 as two slices
def test_flat_and_grouped_plans_split_at_the_price_in_force(cost, parts):
    """The plan of a forward (flat or grouped) prices a part at the group_cost engine_attention set."""
    from specbatch.fast.compute.attention import flat_plan
    kv_lens = np.array([5, 300, 6])
    with scoped_plan(Plan(group_cost=cost)):
        flat = flat_plan(np.arange(3), kv_lens - 1, None, torch.float32, -1e30, "cpu")
        with forward_plan(kv_lens, "cpu"):
            grouped = current_plan().parts
    assert len(flat) == len(grouped) == parts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_parts_compute_what_plain_parts_do(dtype):
    """Plan.sdpa changes the kernel of a part, not its result: keys in float32 beside half-precision
    queries, a query that sees nothing (a flat part's repeats), grouped-query heads."""
    torch.manual_seed(0)
    q = torch.randn(3, 6, 2, 8, dtype=dtype)
    k, v = torch.randn(3, 2, 20, 8), torch.randn(3, 2, 20, 8)
    visible = torch.arange(20)[None, None, :] < torch.tensor([5, 20, 12])[:, None, None]
    visible = visible.expand(3, 2, 20).clone()
    visible[2, 1] = False  # row 2's second query sees nothing
    mask = torch.zeros(3, 2, 20, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)[:, None]  # the model's
    plain = plain_attention(q, k, v, mask, 8 ** -0.5)
    with scoped_plan(Plan(sdpa=True)):
        fused = plain_attention(q, k, v, mask, 8 ** -0.5)
    assert fused.dtype == plain.dtype == dtype and torch.isfinite(fused).all()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    seeing = visible.any(-1)  # [rows, queries]: what a query that sees nothing returns is never read
    torch.testing.assert_close(fused.transpose(1, 2)[seeing], plain.transpose(1, 2)[seeing], **tol)


def test_the_faster_kernel_is_chosen(monkeypatch):
    from specbatch.fast.compute import attention_cost
    for plain_seconds, sdpa_seconds, want in ((2.0, 1.0, True), (1.0, 2.0, False)):
        def timed(fn, repeats, device):
            return sdpa_seconds if current_plan().sdpa else plain_seconds
        monkeypatch.setattr(attention_cost, "_fastest_seconds", timed)
        assert attention_cost.sdpa_is_faster(4, 2, 8, torch.float32, torch.device("cpu")) is want


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_pack_attended_prompt_by_prompt_equals_its_block_diagonal_mask(dtype):
    """segment_attention computes what the packed prefill's mask says (I4), prompt by prompt."""
    from specbatch.fast.compute.attention import segment_attention
    from specbatch.fast.compute.prefill import packed_inputs
    torch.manual_seed(0)
    lengths = [3, 20, 1, 17]
    _, _, mask, _ = packed_inputs([[0] * n for n in lengths], None, dtype, torch.finfo(dtype).min, "cpu")
    q = torch.randn(1, 6, sum(lengths), 8, dtype=dtype)
    k, v = torch.randn(1, 2, sum(lengths), 8, dtype=dtype), torch.randn(1, 2, sum(lengths), 8, dtype=dtype)
    bounds = np.cumsum([0] + lengths)
    got = segment_attention(q, k, v, tuple(zip(bounds[:-1], bounds[1:])), 8 ** -0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=8 ** -0.5, enable_gqa=True)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)


def test_the_engine_prefills_prompt_by_prompt_where_there_is_no_window(monkeypatch):
    from specbatch.fast.compute import attention as attention_module
    seen = []
    real = attention_module.segment_attention
    monkeypatch.setattr(attention_module, "segment_attention", lambda q, k, v, segments, scaling: seen.append(
        segments) or real(q, k, v, segments, scaling))
    target = long_target()
    want = oracle(target, LONG, 4, [EOS])
    result = specbatch.generate(target, None, LONG, max_new_tokens=4, batch_size=len(LONG), strategy="ragged")
    assert result.sequences == want
    per_pack = seen[::target.config.num_hidden_layers]  # every layer of a pack sees the same segments
    assert sorted(end - start for segments in per_pack for start, end in segments) == \
        sorted(len(p) - 1 for p in LONG if len(p) > 1)  # every prompt's content once, whole
    assert any(len(segments) > 1 for segments in per_pack)  # several prompts in one pack, apart


def test_a_windowed_model_prefills_through_its_mask(monkeypatch):
    """With a sliding window the pack's mask hides the tokens beyond it: never prompt by prompt."""
    from specbatch.fast.compute import attention as attention_module
    seen = []
    real = attention_module.segment_attention
    monkeypatch.setattr(attention_module, "segment_attention", lambda *a: seen.append(a[3]) or real(*a))
    target = tiny("mistral", sliding_window=6)
    prompts = [p for p in LONG if 20 < len(p) < 400][:3]
    want = oracle(target, prompts, 4, [EOS])
    assert want != oracle(tiny("mistral"), prompts, 4, [EOS])  # the window changes the output
    result = specbatch.generate(target, None, prompts, max_new_tokens=4, batch_size=3, strategy="ragged")
    assert result.sequences == want and seen == []
