"""Prepacked linear layers (fast.compute.kernels): the same products as nn.Linear up to rounding, bias
included, weights repacked when they change, modules restored after generation, and float32
generation through them equal to transformers' greedy decoding wherever the reference is not a
floating-point tie."""
import json

import numpy as np
import pytest
import torch

import specbatch
from hf_models import EOS, FIXED_K, VOCAB, oracle, tiny
from specbatch.fast.compute import kernels, row_plan
from specbatch.fast.drafts.scripted import ScriptedDraft
from specbatch.fast.equivalence import compare
from specbatch.reference import deviate_hashed

pytestmark = pytest.mark.skipif(not kernels.available(), reason="oneDNN is not available in this torch build")
RNG = np.random.default_rng(3)
PROMPTS = [RNG.integers(0, VOCAB, n).tolist() for n in (1, 30, 7, 64, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_equals_the_plain_product(dtype, bias):
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN packs bfloat16 only with avx512 or avx_ne_convert (this CPU: the layer stays plain)")
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80, bias=bias).to(dtype)
    x = torch.randn(5, 3, 48, dtype=dtype)
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    with torch.inference_mode(), kernels.prepacked_linears(layer) as count:
        assert count == 1
        got = layer(x)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    assert "forward" not in vars(layer)  # the module's own forward is back


@pytest.mark.skipif(torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN packs bfloat16 on this CPU")
def test_a_layer_onednn_refuses_stays_plain():
    """Where oneDNN cannot pack bfloat16 (AVX2 CPUs), prepacking leaves such a layer alone: its own
    forward, the same numbers."""
    layer = torch.nn.Linear(48, 80).to(torch.bfloat16)
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    with torch.inference_mode(), kernels.prepacked_linears(layer) as count:
        assert count == 0 and "forward" not in vars(layer)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


class ScriptedCosts:
    """A time_pass for fast.compute.row_plan whose seconds come from a table: cost[m] for a pass at m
    rows (the same for every repeat unless `spread`), recording what it was asked."""

    def __init__(self, cost, spread=0.0):
        self.cost, self.spread, self.asked = cost, spread, []

    def __call__(self, rows, padded):
        self.asked.append((rows, padded))
        wobble = self.spread * (len(self.asked) % 3 - 1)  # -spread, 0, +spread in turn
        return self.cost(padded) + wobble


def one_row_slow(m):
    return {1: 3.0, 2: 2.0, 3: 2.5, 4: 1.0}.get(m, float(m))


def test_a_row_count_is_padded_to_the_cheapest_candidate_that_beat_it_every_time():
    plans = row_plan.RowPlans(None, "machine")
    timer = ScriptedCosts(one_row_slow)
    assert plans.rows_for("c", 1, timer) == 4  # 1 row costs 3.0, 4 rows 1.0: padded
    assert {m for _, m in timer.asked} == set(row_plan.candidates(1)) == {1, 2, 3, 4}
    assert plans.rows_for("c", 5, timer) == 5  # costs grow with the rows from 5 on: not padded
    asked = len(timer.asked)
    assert plans.rows_for("c", 1, timer) == 4 and len(timer.asked) == asked  # decided once
    assert plans.rows_for("other", 1, ScriptedCosts(float)) == 1  # each shape class decides for itself


def test_noise_never_pads():
    """Where the passes of the cheapest candidate overlap those of the row count itself, no padding."""
    cost = {3: 1.0, 4: 0.9}
    assert row_plan.cheapest(3, {3: [1.0, 1.1, 1.2], 4: [0.9, 0.95, 1.05], 5: [2.0] * 3, 6: [2.0] * 3}) == 3
    assert row_plan.cheapest(3, {3: [1.0, 1.1, 1.2], 4: [0.7, 0.8, 0.99], 5: [2.0] * 3, 6: [2.0] * 3}) == 4
    assert row_plan.RowPlans(None, "m").rows_for("c", 3, ScriptedCosts(lambda m: cost.get(m, 9.0), 0.06)) == 3
    assert row_plan.RowPlans(None, "m").rows_for("c", 3, ScriptedCosts(lambda m: cost.get(m, 9.0), 0.04)) == 4


def test_the_least_median_wins_and_ties_go_to_fewer_rows():
    passes = {8: [5.0] * 3, 9: [3.0, 3.0, 4.0], 10: [3.5, 3.5, 3.5], 11: [3.0, 3.0, 3.9]}
    assert row_plan.cheapest(8, passes) == 9
    assert row_plan.cheapest(8, {**passes, 10: [2.0, 2.0, 4.9]}) == 10  # the median, not the best pass


def test_counts_past_max_rows_are_never_timed_or_padded():
    timer = ScriptedCosts(lambda m: 1.0 / m)  # more rows always cheaper: padding would always win
    plans = row_plan.RowPlans(None, "m")
    assert plans.rows_for("c", row_plan.MAX_ROWS + 1, timer) == row_plan.MAX_ROWS + 1 and timer.asked == []
    assert plans.rows_for("c", 0, timer) == 0 and timer.asked == []
    assert plans.rows_for("c", row_plan.MAX_ROWS, timer) > row_plan.MAX_ROWS


def test_decisions_are_kept_on_disk_for_this_machine_only(tmp_path):
    path = tmp_path / "plans.json"
    first = row_plan.RowPlans(path, "machine A")
    assert first.rows_for("c", 1, ScriptedCosts(one_row_slow)) == 4
    again = ScriptedCosts(float)  # would not pad: the saved decision must be what answers
    assert row_plan.RowPlans(path, "machine A").rows_for("c", 1, again) == 4 and again.asked == []
    other = ScriptedCosts(float)
    assert row_plan.RowPlans(path, "machine B").rows_for("c", 1, other) == 1 and other.asked  # measured again
    path.write_text("{not json")
    broken = ScriptedCosts(one_row_slow)
    assert row_plan.RowPlans(path, "machine A").rows_for("c", 1, broken) == 4 and broken.asked
    assert json.loads(path.read_text())["classes"]["c"]["padded"] == {"1": 4}  # replaced by a readable file


def test_the_machine_key_names_the_threads():
    threads = torch.get_num_threads()
    assert f"| {threads} threads |" in row_plan.machine_key()
    try:
        other = 1 if threads != 1 else 2
        torch.set_num_threads(other)
        assert f"| {other} threads |" in row_plan.machine_key()  # another thread count, other costs
    finally:
        torch.set_num_threads(threads)


@pytest.fixture()
def pad_two_to_three(monkeypatch):
    """Plans under which two rows are padded to three in every shape class (measured as cheaper)."""
    plans = row_plan.RowPlans(None, row_plan.machine_key())
    monkeypatch.setattr(row_plan, "_PLANS", plans)
    monkeypatch.setattr(row_plan, "plans", lambda: plans)
    original = plans.rows_for
    monkeypatch.setattr(plans, "rows_for", lambda key, rows, time_pass: original(
        key, rows, lambda n, m: {2: 2.0, 3: 1.0}.get(m, float(m)) if n == 2 else float(m)))
    monkeypatch.setattr(plans, "plain_for", lambda key, rows, time_step: False)  # the packed kernel
    return plans


@pytest.mark.parametrize("shape", [(2, 48), (1, 2, 48), (2, 1, 48)])
def test_padded_rows_come_back_as_their_own_rows(shape, pad_two_to_three):
    """Where two rows go to oneDNN padded to three, each comes back as its own product, in the
    input's shape, exactly as it is computed within three rows."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80)
    x = torch.randn(*shape)
    with torch.inference_mode(), kernels.prepacked_linears(layer):
        got = layer(x)
        three = layer(torch.cat([x.reshape(2, 48), torch.randn(1, 48)]))
    assert pad_two_to_three.classes[row_plan.RowPlans.class_key(layer.weight)]["padded"][2] == 3
    assert got.shape == shape[:-1] + (80,)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.reshape(2, 80), three[:2])  # the same kernel as three rows: the padding is real
    assert not torch.equal(got.reshape(2, 80)[0], got.reshape(2, 80)[1])


def test_a_shape_class_is_timed_over_all_its_layers_as_the_forward_runs_them(monkeypatch):
    """The real timer: one padded product per weight of the class, its decision within the candidates."""
    products = []
    real_product = row_plan.padded_product
    monkeypatch.setattr(row_plan, "padded_product", lambda x, packed, bias, padded: products.append(
        (x.shape[0], padded)) or real_product(x, packed, bias, padded))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 96, bias=False) for _ in range(3)]
    calls = []
    with torch.inference_mode(), kernels.prepacked_linears(*layers):
        packed = [kernels._packed_weight(layer) for layer in layers]
        timer = row_plan.class_timer(packed, 64, torch.float32)
        counted = lambda rows, padded: calls.append((rows, padded)) or timer(rows, padded)  # noqa: E731
        chosen = row_plan.RowPlans(None, "m").rows_for("c", 2, counted)
        assert chosen in row_plan.candidates(2) and timer(2, 5) > 0
    assert sorted(set(calls)) == [(2, m) for m in row_plan.candidates(2)]
    assert len(calls) == (row_plan.REPEATS + 1) * len(row_plan.candidates(2))  # a warm-up pass, then the repeats
    assert products.count((2, 5)) == (row_plan.REPEATS + 1) * 3 + 3  # each pass: the 3 layers, 2 rows padded to 5
    products.clear()
    row_plan.class_timer(packed * 3, 64, torch.float32)(1, 2)
    assert len(products) == row_plan.SAMPLE < 3 * len(packed)  # a big class is timed on a sample of its weights


def scripted_step(costs, asked):
    """A time_step for RowPlans.plain_for: costs[key] = (plain passes, packed passes) at every row count."""
    return lambda rows: asked.append(rows) or costs


def test_the_plain_product_is_chosen_where_every_pass_of_a_whole_step_beat_the_packed_one():
    plans, asked = row_plan.RowPlans(None, "m"), []
    costs = {"a": ([1.0, 1.1, 1.2], [1.3, 1.4, 1.5]),  # plain beat packed in every pass
             "b": ([1.0, 1.1, 1.4], [1.3, 1.4, 1.5]),  # overlapping passes: noise never switches
             "c": ([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])}
    step = scripted_step(costs, asked)
    assert plans.plain_for("a", 1, step) and asked == [1]
    assert not plans.plain_for("b", 1, step) and not plans.plain_for("c", 1, step)
    assert asked == [1]  # one whole-step measurement decided every class it timed
    assert not plans.plain_for("d", 1, step) and asked == [1, 1]  # a class the step did not time: packed
    assert not plans.plain_for("a", row_plan.MAX_ROWS + 1, step) and not plans.plain_for("a", 0, step)
    assert asked == [1, 1]  # prefill chunks and empty forwards are never timed


def test_kernel_decisions_are_kept_on_disk_and_an_older_file_is_measured_again(tmp_path):
    path, asked = tmp_path / "plans.json", []
    step = scripted_step({"a": ([1.0] * 3, [2.0] * 3)}, asked)
    assert row_plan.RowPlans(path, "machine A").plain_for("a", 2, step) and asked == [2]
    assert row_plan.RowPlans(path, "machine A").plain_for("a", 2, step) and asked == [2]  # read back
    saved = json.loads(path.read_text())
    saved.pop("format")
    path.write_text(json.dumps(saved))  # a file from before the kernel decisions
    assert row_plan.RowPlans(path, "machine A").plain_for("a", 2, step) and asked == [2, 2]


def test_rows_go_to_torchs_product_where_the_plans_chose_it(monkeypatch):
    """Where the whole-step timing chose torch's product for one row, the forward computes one row
    with it (bitwise F.linear, the packed kernel never called) and three rows packed."""
    plans = row_plan.RowPlans(None, row_plan.machine_key())
    monkeypatch.setattr(row_plan, "plans", lambda: plans)
    monkeypatch.setattr(plans, "plain_for", lambda key, rows, time_step: rows == 1)
    monkeypatch.setattr(plans, "rows_for", lambda key, rows, time_pass: rows)  # no padding measured
    packed_calls = []
    real = row_plan.padded_product
    monkeypatch.setattr(row_plan, "padded_product", lambda x, *a: packed_calls.append(x.shape) or real(x, *a))
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80)
    one, three = torch.randn(1, 48), torch.randn(3, 48)
    with torch.inference_mode(), kernels.prepacked_linears(layer):
        got_one, got_three = layer(one), layer(three)
    assert torch.equal(got_one, torch.nn.functional.linear(one, layer.weight, layer.bias))
    assert packed_calls == [(3, 48)]
    torch.testing.assert_close(got_three, torch.nn.functional.linear(three, layer.weight, layer.bias))


def test_the_step_timer_streams_every_weight_once_per_kernel_in_forward_order(monkeypatch):
    torch.manual_seed(0)
    small = [torch.nn.Linear(32, 24, bias=False) for _ in range(3)]
    head = torch.nn.Linear(32, 96, bias=False)
    calls = []
    real = row_plan.product
    monkeypatch.setattr(row_plan, "product", lambda x, w, packed, bias, plan: calls.append(
        (w.shape[0], plan)) or real(x, w, packed, bias, plan))
    with torch.inference_mode():
        classes = list(kernels._row_classes(small + [head]))
        spent = kernels.step_timer(classes)(2)
    assert set(spent) == {row_plan.RowPlans.class_key(small[0].weight), row_plan.RowPlans.class_key(head.weight)}
    assert all(len(plain) == len(packed) == row_plan.REPEATS for plain, packed in spent.values())
    per_pass = 4  # every weight of every class, once
    assert len(calls) == 2 * (row_plan.REPEATS + 1) * per_pass
    assert [c[0] for c in calls[:per_pass]] == [24, 96, 24, 24]  # the first weight of each class, then the rest
    assert {plan for _, plan in calls[:per_pass]} == {2} and {plan for _, plan in calls[per_pass:2 * per_pass]} == \
        {row_plan.PLAIN}  # a packed pass, then a plain one (the order alternates)


def test_a_benchmark_decides_every_row_count_before_it_times_anything(monkeypatch):
    plans = row_plan.RowPlans(None, row_plan.machine_key())
    monkeypatch.setattr(row_plan, "plans", lambda: plans)
    from specbatch.fast.compute.lean_llama import LeanCausalLM
    target = tiny("llama", dtype=torch.float32)
    models = (target, LeanCausalLM.of(target))  # the lean forward's fused projections are classes of their own
    classes = {row_plan.RowPlans.class_key(m.weight) for model in models for m in model.modules()
               if isinstance(m, torch.nn.Linear)}
    assert kernels.prepare_row_plans(*models, up_to=5) == 2 * 5 * len(classes)  # a kernel and a padding each
    assert {key: (sorted(entry["padded"]), sorted(entry["plain"])) for key, entry in plans.classes.items()} == \
        {key: ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]) for key in classes}
    assert kernels.prepare_row_plans(*models, up_to=5) == 0  # decided once
    timed = []
    monkeypatch.setattr(row_plan, "class_timer", lambda *a: lambda rows, padded: timed.append(rows) or 1.0)
    monkeypatch.setattr(kernels, "step_timer", lambda classes: lambda rows: timed.append(rows) or {})
    specbatch.generate(target, None, [[1, 2, 3]], max_new_tokens=4, batch_size=1, strategy="ragged")
    assert timed == [] or min(timed) > 5  # nothing at 1..5 rows was measured during the run


def test_a_changed_weight_is_repacked_and_float64_is_left_alone():
    torch.manual_seed(1)
    layer = torch.nn.Linear(16, 16, bias=False)
    x = torch.randn(2, 16)
    with torch.inference_mode():
        with kernels.prepacked_linears(layer):
            before = layer(x)
        layer.weight.mul_(2)
        with kernels.prepacked_linears(layer):
            after = layer(x)
    torch.testing.assert_close(after, 2 * before, rtol=1e-5, atol=1e-5)
    with kernels.prepacked_linears(torch.nn.Linear(4, 4).double()) as count:
        assert count == 0


def with_random_biases(model):
    """A copy whose linear biases are not zero (transformers initialises them to zero)."""
    import copy
    model = copy.deepcopy(model)
    torch.manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("strategy", ["ragged", "eqspec", "exspec"])
@pytest.mark.parametrize("arch", ["llama", "opt", "qwen3"])
def test_float32_generation_through_prepacked_layers_matches_up_to_ties(arch, strategy):
    target = with_random_biases(tiny(arch, dtype=torch.float32))
    want = oracle(target, PROMPTS, 12, [EOS])
    draft = ScriptedDraft(target, deviate_hashed(2, 0.3))
    with kernels.prepacked_linears(target) as count:
        assert count > 0  # the path under test really is the prepacked one
    result = specbatch.generate(target, draft, PROMPTS, max_new_tokens=12, num_draft_tokens=3, batch_size=3,
                                strategy=strategy, **FIXED_K)
    reports = compare(target, PROMPTS, result.sequences, want, tolerance=1e-3)
    assert [r for r in reports if not r["exact"] and r["kind"] == "error"] == []
    assert sum(r["exact"] for r in reports) >= len(PROMPTS) - 1
    plain = specbatch.generate(target, draft, PROMPTS, max_new_tokens=12, num_draft_tokens=3, batch_size=3,
                               strategy=strategy, prepack=False, **FIXED_K)
    reports = compare(target, PROMPTS, plain.sequences, result.sequences, tolerance=1e-3)
    assert [r for r in reports if not r["exact"] and r["kind"] == "error"] == []


def test_a_prepacked_layer_that_drops_its_bias_is_caught(monkeypatch):
    """Mutation check: the generation test above fails when the bias is left out."""
    class NoBias(kernels.PackedForward):
        def __call__(self, x):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
    target = with_random_biases(tiny("opt", dtype=torch.float32))
    want = oracle(target, PROMPTS, 12, [EOS])
    monkeypatch.setattr(kernels, "PackedForward", NoBias)
    result = specbatch.generate(target, None, PROMPTS, max_new_tokens=12, batch_size=3, strategy="ragged")
    reports = compare(target, PROMPTS, result.sequences, want, tolerance=1e-3)
    assert any(not r["exact"] and r["kind"] == "error" for r in reports)


@pytest.mark.full
def test_compiled_blocks_give_the_same_tokens():
    """compile=True (inductor on the MLP blocks and norms) runs the same decoding."""
    target = tiny("llama", dtype=torch.float32)
    plain = specbatch.generate(target, None, PROMPTS, max_new_tokens=8, batch_size=3, strategy="ragged")
    compiled = specbatch.generate(target, None, PROMPTS, max_new_tokens=8, batch_size=3, strategy="ragged",
                                  compile=True)
    reports = compare(target, PROMPTS, compiled.sequences, plain.sequences, tolerance=1e-3)
    assert [r for r in reports if not r["exact"] and r["kind"] == "error"] == []
    assert "forward" not in vars(target.model.layers[0].mlp)  # restored afterwards


@pytest.mark.parametrize("strategy", ["ragged", "eqspec"])
def test_generation_with_every_row_count_padded_matches_up_to_ties(strategy, monkeypatch):
    """Padding changes no row's product beyond rounding: with every count padded by three rows (as
    if measured cheaper), generation still equals transformers' greedy decoding up to ties."""
    plans = row_plan.RowPlans(None, row_plan.machine_key())
    monkeypatch.setattr(row_plan, "plans", lambda: plans)
    original = plans.rows_for
    monkeypatch.setattr(plans, "rows_for", lambda key, rows, time_pass: original(
        key, rows, lambda n, m: 1.0 if m == n + 3 else 2.0 + m))
    monkeypatch.setattr(plans, "plain_for", lambda key, rows, time_step: False)  # the packed kernel
    target = with_random_biases(tiny("llama", dtype=torch.float32))
    want = oracle(target, PROMPTS, 12, [EOS])
    draft = ScriptedDraft(target, deviate_hashed(2, 0.3))
    result = specbatch.generate(target, draft, PROMPTS, max_new_tokens=12, num_draft_tokens=3, batch_size=3,
                                strategy=strategy, **FIXED_K)
    padded = [m - n for entry in plans.classes.values() for n, m in entry["padded"].items()]
    assert padded and set(padded) == {3}  # every forward of the run went through a padded product
    reports = compare(target, PROMPTS, result.sequences, want, tolerance=1e-3)
    assert [r for r in reports if not r["exact"] and r["kind"] == "error"] == []
    assert sum(r["exact"] for r in reports) >= len(PROMPTS) - 1


@pytest.mark.parametrize("strategy", ["ragged", "eqspec"])
def test_generation_with_some_row_counts_on_torchs_product_matches_up_to_ties(strategy, monkeypatch):
    """Kernels mixed by row count (torch's product for odd counts, as if measured faster; packed for
    even ones) change no token beyond rounding: generation equals transformers' greedy decoding up
    to ties, and both kernels really ran."""
    plans = row_plan.RowPlans(None, row_plan.machine_key())
    monkeypatch.setattr(row_plan, "plans", lambda: plans)
    monkeypatch.setattr(plans, "plain_for", lambda key, rows, time_step: rows % 2 == 1)
    monkeypatch.setattr(plans, "rows_for", lambda key, rows, time_pass: rows)
    ran = set()
    real = row_plan.padded_product
    monkeypatch.setattr(row_plan, "padded_product", lambda x, *a: ran.add("packed") or real(x, *a))
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: ran.add("plain") or real_linear(*a, **k))
    target = with_random_biases(tiny("llama", dtype=torch.float32))
    want = oracle(target, PROMPTS, 12, [EOS])
    draft = ScriptedDraft(target, deviate_hashed(2, 0.3))
    ran.clear()
    result = specbatch.generate(target, draft, PROMPTS, max_new_tokens=12, num_draft_tokens=3, batch_size=3,
                                strategy=strategy, **FIXED_K)
    assert ran == {"plain", "packed"}
    reports = compare(target, PROMPTS, result.sequences, want, tolerance=1e-3)
    assert [r for r in reports if not r["exact"] and r["kind"] == "error"] == []
    assert sum(r["exact"] for r in reports) >= len(PROMPTS) - 1
