"""Prepacked linear layers (fast.compute.kernels): the same products as nn.Linear up to rounding, bias
included, weights repacked when they change, modules restored after generation, and float32
generation through them equal to transformers' greedy decoding wherever the reference is not a
floating-point tie."""
import numpy as np
import pytest
import torch

import specbatch
from hf_models import EOS, FIXED_K, VOCAB, oracle, tiny
from specbatch.fast.compute import kernels
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


@pytest.mark.parametrize("shape", [(2, 48), (1, 2, 48), (2, 1, 48)])
def test_two_rows_are_padded_and_come_back_as_their_own_rows(shape, monkeypatch):
    """Where two rows go to oneDNN padded to three (PADDED_ROWS, on AVX-512 CPUs), each comes back
    as its own product, in the input's shape, exactly as it is computed within three rows."""
    monkeypatch.setattr(kernels, "PADDED_ROWS", {2: 3})
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80)
    x = torch.randn(*shape)
    with torch.inference_mode(), kernels.prepacked_linears(layer):
        got = layer(x)
        three = layer(torch.cat([x.reshape(2, 48), torch.randn(1, 48)]))
    assert got.shape == shape[:-1] + (80,)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.reshape(2, 80), three[:2])  # the same kernel as three rows: the padding is real
    assert not torch.equal(got.reshape(2, 80)[0], got.reshape(2, 80)[1])


def test_rows_are_padded_on_avx512_only():
    """The padding was measured to pay on an AVX-512 CPU and to cost ~8% of a two-token verify on
    an AVX2 one (kernels.padded_rows_for)."""
    assert kernels.padded_rows_for("AVX512") == {2: 3}
    assert kernels.padded_rows_for("AVX2") == {} and kernels.padded_rows_for("DEFAULT") == {}
    assert kernels.PADDED_ROWS == kernels.padded_rows_for(torch.backends.cpu.get_cpu_capability())


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
    def no_bias(module, packed):
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    target = with_random_biases(tiny("opt", dtype=torch.float32))
    want = oracle(target, PROMPTS, 12, [EOS])
    monkeypatch.setattr(kernels, "_packed_forward", no_bias)
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
