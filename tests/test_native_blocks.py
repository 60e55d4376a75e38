"""fast.compute.native: the lean forward's C++ block loop computes bitwise what its Python loop computes,
in every flat forward the ragged strategy runs (decode, chain and tree verify, float64, float32 on
prepacked and padded products, bfloat16 over a float32 cache, SDPA's kernel, gathered row parts),
and the engine falls back to Python where the extension cannot be built."""
import os
import shutil

import pytest
import torch

import specbatch
from hf_models import EOS, FIXED_K, oracle, tiny
from specbatch.fast.compute import attention, lean_llama, native, row_plan
from specbatch.fast.drafts.scripted import ScriptedDraft
from specbatch.reference import deviate_hashed

PROMPTS = [[1, 5, 9, 4], [3, 3], [8, 2, 6, 1, 9, 9, 4, 7, 7, 2, 5], [6], [2, 4, 6, 8, 1, 3, 5]]

COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
pytestmark = pytest.mark.skipif(not COMPILER, reason="no C++ compiler here: the engine runs its blocks in Python")


def test_the_extension_builds_where_there_is_a_compiler():
    assert native.extension() is not None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_element_wise_kernels_compute_torchs_steps_each_row_on_its_own(dtype):
    """rms_norm, rotate and silu_mul against lean_llama.TorchOps up to rounding (widths that are and
    are not a multiple of the kernels' 16 lanes; the rotation reads the q/k heads of a wider q/k/v
    product); and a row's result is bitwise the same alone, among 13 rows (one thread) and among 300
    rows (a prefill's, shared among threads when torch has more than one) (I8)."""
    kernels, ops = native.extension(), lean_llama.TORCH_OPS
    generator = torch.Generator().manual_seed(3)
    randn = lambda *shape: (4 * torch.randn(*shape, generator=generator, dtype=torch.float64)).to(dtype)  # noqa: E731
    tolerance = {torch.float64: 1e-12, torch.float32: 4e-6, torch.bfloat16: 2e-2}[dtype]

    def close(a, b):
        scale = b.double().abs().max().item()
        assert a.dtype == b.dtype and a.shape == b.shape
        assert (a.double() - b.double()).abs().max().item() <= tolerance * scale

    for width in (100, 576):
        x, weight = randn(1, 13, width), randn(width)
        close(kernels.rms_norm(x, weight, 1e-5), ops.rms_norm(x, weight, 1e-5))
        gate_up = randn(1, 13, 2 * width)
        close(kernels.silu_mul(gate_up), ops.silu_mul(gate_up))
        assert torch.equal(kernels.rms_norm(x[:, 5:6], weight, 1e-5), kernels.rms_norm(x, weight, 1e-5)[:, 5:6])
        assert torch.equal(kernels.silu_mul(gate_up[:, 5:6]), kernels.silu_mul(gate_up)[:, 5:6])
    qkv, cos, signed_sin = randn(1, 13, 6, 64), randn(1, 13, 1, 64), randn(1, 13, 1, 64)
    close(kernels.rotate(qkv[:, :, :4], cos, signed_sin), ops.rotate(qkv[:, :, :4], cos, signed_sin))
    assert torch.equal(kernels.rotate(qkv[:, 5:6, :4], cos[:, 5:6], signed_sin[:, 5:6]),
                       kernels.rotate(qkv[:, :, :4], cos, signed_sin)[:, 5:6])
    many = 300  # rows enough to pass torch's grain of element-wise work: split among the threads
    x, weight, gate_up = randn(1, many, 576), randn(576), randn(1, many, 2 * 576)
    qkv, cos, signed_sin = randn(1, many, 6, 64), randn(1, many, 1, 64), randn(1, many, 1, 64)
    together = (kernels.rms_norm(x, weight, 1e-5), kernels.silu_mul(gate_up),
                kernels.rotate(qkv[:, :, :4], cos, signed_sin))
    for row in (0, 151, many - 1):
        alone = (kernels.rms_norm(x[:, row:row + 1], weight, 1e-5), kernels.silu_mul(gate_up[:, row:row + 1]),
                 kernels.rotate(qkv[:, row:row + 1, :4], cos[:, row:row + 1], signed_sin[:, row:row + 1]))
        assert all(torch.equal(a, t[:, row:row + 1]) for a, t in zip(alone, together))
    close(together[2], ops.rotate(qkv[:, :, :4], cos, signed_sin))
    if dtype == torch.float32:  # SiLU's exp over its whole range: saturated, tiny and ordinary gates
        gate_up = torch.tensor([[-200.0, -87.5, -30.0, -1e-3, 0.0, 2.5, 40.0, 200.0] + [1.0] * 8])
        close(kernels.silu_mul(gate_up), ops.silu_mul(gate_up))


@pytest.fixture
def checked(monkeypatch):
    """Every native forward is checked against the Python loop on the same inputs and cache: the
    outputs and every K/V buffer after the forward must be bitwise equal. Yields the list of
    forwards checked."""
    real, forwards = native.flat_blocks, []

    def both(decoder, hidden, cos, signed_sin, cache):
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers if layer.is_initialized]
        out = real(decoder, hidden, cos, signed_sin, cache)
        if out is None:
            return None
        after = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        for layer, (keys, values) in zip(cache.layers, before):
            layer.keys.copy_(keys)
            layer.values.copy_(values)
        python, ops = hidden, native.element_ops(hidden)
        for index, block in enumerate(decoder.blocks):
            python = block.forward(python, cos, signed_sin, None, cache, index, ops)
        assert out.dtype == python.dtype and torch.equal(out, python), "native output differs from Python's"
        for layer, (keys, values) in zip(cache.layers, after):
            assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values), "native K/V differ"
        forwards.append(hidden.shape[1])
        return out

    monkeypatch.setattr(lean_llama, "native_blocks", both)
    return forwards


def generate(target, draft=None, **kw):
    return specbatch.generate(target, draft, PROMPTS, max_new_tokens=10, batch_size=3, strategy="ragged",
                              eos_token_id=[EOS], **kw)


@pytest.mark.parametrize("branches", [1, 3])
def test_native_blocks_are_the_python_loop_bitwise_and_exact_in_float64(checked, branches):
    target = tiny("llama", layers=2, seed=0)
    draft = ScriptedDraft(target, deviate_hashed(2, 0.3), swap=True)
    result = generate(target, draft, num_draft_tokens=3, tree_branches=branches, check_invariants=True, **FIXED_K)
    assert result.sequences == oracle(target, PROMPTS, 10, [EOS])
    assert max(checked) > 3  # verify forwards (several queries per row) ran natively, not only decode steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_blocks_on_prepacked_and_padded_products(checked, monkeypatch, dtype):
    """Every row count padded by two rows, or odd counts on torch's product: both kernels, natively."""
    plans = row_plan.RowPlans(None, row_plan.machine_key())
    monkeypatch.setattr(row_plan, "plans", lambda: plans)
    monkeypatch.setattr(plans, "plain_for", lambda key, rows, time_step: rows % 2 == 1)
    monkeypatch.setattr(plans, "rows_for", lambda key, rows, time_pass: rows + 2)
    target = tiny("llama", layers=2, seed=4, dtype=dtype)
    draft = ScriptedDraft(target, deviate_hashed(5, 0.3))
    generate(target, draft, num_draft_tokens=3, **FIXED_K)
    assert {n % 2 for n in checked} == {0, 1}


def test_weights_changed_between_runs_are_read_anew(checked, monkeypatch):
    """The native loop keeps its lists of weights per decoder between forwards; a weight changed in
    place between two runs is repacked, and the second run must read the new packed copy."""
    plans = row_plan.RowPlans(None, row_plan.machine_key())
    monkeypatch.setattr(row_plan, "plans", lambda: plans)
    monkeypatch.setattr(plans, "plain_for", lambda key, rows, time_step: False)
    monkeypatch.setattr(plans, "rows_for", lambda key, rows, time_pass: rows)
    target = tiny("llama", layers=2, seed=8, dtype=torch.float32)
    first = generate(target).sequences
    with torch.no_grad():
        for layer in target.model.layers:  # the output and down projections are the model's own modules
            layer.self_attn.o_proj.weight.mul_(-3.0)
            layer.mlp.down_proj.weight.mul_(-3.0)
    checked.clear()
    second = generate(target).sequences
    assert checked and second != first


@pytest.mark.parametrize("sdpa", [False, True])
def test_native_blocks_with_gathered_row_parts_and_sdpa(checked, monkeypatch, sdpa):
    """A part costs one row-slot: rows are split into up to four parts, some gathered by index."""
    monkeypatch.setattr(attention, "_measured_pricing", lambda modules: (sdpa, 1.0))
    target = tiny("llama", layers=2, seed=6, dtype=torch.float32, num_attention_heads=4, num_key_value_heads=2)
    draft = ScriptedDraft(target, deviate_hashed(7, 0.4))
    generate(target, draft, num_draft_tokens=2, tree_branches=2, temperature=0.8, **FIXED_K)
    assert checked


def test_native_off_and_unavailable_run_the_python_loop(checked, monkeypatch):
    target = tiny("llama", layers=2, seed=0)
    want = oracle(target, PROMPTS, 10, [EOS])
    assert generate(target, native=False).sequences == want and checked == []
    monkeypatch.setattr(native, "extension", lambda: None)
    assert generate(target).sequences == want and checked == []
    assert generate(tiny("qwen3", layers=2, seed=0)).sequences == oracle(tiny("qwen3", layers=2, seed=0), PROMPTS,
                                                                       10, [EOS]) and checked == []


def test_a_source_that_does_not_build_falls_back_with_one_warning(tmp_path, monkeypatch):
    broken = tmp_path / "native_blocks.cpp"
    broken.write_text("#include <torch/extension.h>\nthis is not C++;\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    monkeypatch.setattr(native, "_BUILT", {})
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="could not be built here.*runs its blocks in Python"):
        assert native.extension() is None
    assert native.extension() is None  # decided once per process


def test_a_compiler_without_openmp_still_builds_it_single_threaded(tmp_path, monkeypatch):
    """Where torch has OpenMP but the compiler rejects -fopenmp (Apple's clang), the extension is
    built without it (at::parallel_for then runs on one thread) instead of not at all."""
    import warnings

    from torch.utils import cpp_extension
    if not torch.backends.openmp.is_available():
        pytest.skip("torch without OpenMP builds without it anyway")
    built, sentinel = [], object()

    def load(name, sources, extra_cflags=(), extra_ldflags=(), **kwargs):
        built.append((name, list(extra_cflags), list(extra_ldflags)))
        if "-fopenmp" in extra_cflags:
            raise RuntimeError("clang: error: unsupported option '-fopenmp'")
        return sentinel
    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(native, "_BUILT", {})
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: it was built
        assert native.extension() is sentinel
    (first, first_flags, first_links), (second, second_flags, second_links) = built
    assert "-fopenmp" in first_flags and "-fopenmp" in first_links
    assert "-fopenmp" not in second_flags + second_links and first != second  # its own cache folder


def test_each_environment_builds_its_own(monkeypatch):
    """Two environments sharing the cache folder get two build folders (a shared one is rebuilt by
    each in turn: their build arguments differ)."""
    here = native.build_name()
    monkeypatch.setattr(native.sys, "prefix", native.sys.prefix + "-another-venv")
    assert native.build_name() != here


def test_the_bench_builds_it_before_it_times_anything(monkeypatch):
    """`specbatch bench` prepares the extension with the row plans, before its first timed run (a
    first compile takes some 30 s); not with native=False."""
    import dataclasses

    from specbatch.cli.bench import prepare_kernels
    from specbatch.options import defaults
    built = []
    monkeypatch.setattr(native, "extension", lambda: built.append(1))
    prepare_kernels(None, None, dataclasses.replace(defaults(), prepack=False))
    assert built == [1]
    prepare_kernels(None, None, dataclasses.replace(defaults(), prepack=False, native=False))
    assert built == [1]


def test_the_cli_turns_it_off():
    from specbatch.cli.commands import build_parser
    from specbatch.options import DEFAULTS
    assert build_parser().parse_args(["generate", "--target", "smollm2", "--prompts", "p.jsonl", "--no-native"]).native is False
    assert build_parser().parse_args(["generate", "--target", "smollm2", "--prompts", "p.jsonl"]).native is None  # the default: on
    assert DEFAULTS.native is True
