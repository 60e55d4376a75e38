"""fast.compute.backend: the speed choices by device, and the engine under an accelerator's choices (one
fused SDPA call over every row of the ragged layout, no prepacked linears, K/V in the model's
dtype), run on the test device: exact against transformers' greedy decoding, every strategy and
draft kind, and equal to target-only decoding in bfloat16 and float16 up to ties."""
import numpy as np
import pytest
import torch

import specbatch
from hf_models import EOS, FIXED_K, VOCAB, assert_ties_only, oracle, tiny
from specbatch.fast.compute import attention, kernels
from specbatch.fast.compute.backend import CHOICES, for_device
from specbatch.fast.drafts.scripted import ScriptedDraft
from specbatch.fast.drafts.lookup_draft import LookupFirstDraft
from specbatch.reference import deviate_hashed
from profiles import grid

RNG = np.random.default_rng(11)
PROMPTS = [RNG.integers(0, VOCAB, n).tolist() for n in (1, 30, 4, 75, 9)]
PROMPTS[2][1] = EOS  # the pad id (== EOS) inside a prompt


def test_choices_follow_the_device_and_the_override(monkeypatch):
    monkeypatch.delenv("SPECBATCH_BACKEND", raising=False)
    assert for_device("cpu") is CHOICES["cpu"] and for_device(torch.device("cpu")).grouped_attention
    for accelerator in ("cuda", "cuda:1", torch.device("cuda", 0)):
        chosen = for_device(accelerator)
        assert chosen is CHOICES["cuda"]
        assert not (chosen.prepack_linears or chosen.wide_half_kv or chosen.grouped_attention)
    monkeypatch.setenv("SPECBATCH_BACKEND", "cuda")
    assert for_device("cpu") is CHOICES["cuda"]
    monkeypatch.setenv("SPECBATCH_BACKEND", "tpu")
    with pytest.raises(ValueError, match="SPECBATCH_BACKEND='tpu' is not one of cpu, cuda"):
        for_device("cpu")


def attention_calls(monkeypatch) -> list:
    """Query widths of every SDPA call from here on."""
    widths, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def counted(query, *args, **kwargs):
        widths.append(query.shape[2])
        return sdpa(query, *args, **kwargs)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counted)
    return widths


def drafts(target):
    from specbatch.fast.loading import load_draft
    return {"none": None, "self": target, "scripted": ScriptedDraft(target, deviate_hashed(5, 0.3)),
            "random+lookup": LookupFirstDraft(tiny("llama", layers=1, seed=4)),
            "lookup": load_draft("lookup", target, device=target.device)[0]}


@pytest.mark.parametrize("backend,strategy,draft", grid(backend=["cpu", "cuda"], strategy=["eqspec", "exspec", "ragged"],
                                                        draft=["none", "self", "scripted", "random+lookup", "lookup"]))
def test_each_backend_equals_transformers_greedy(monkeypatch, backend, strategy, draft):
    monkeypatch.setenv("SPECBATCH_BACKEND", backend)
    target = tiny("llama")
    budgets = [9, 3, 12, 7, 10]
    want = oracle(target, PROMPTS, budgets, [EOS])
    measured_sdpa = attention._measured_pricing([target])[0]  # the CPU's kernel, measured (and kept) before counting
    widths = attention_calls(monkeypatch)
    result = specbatch.generate(target, drafts(target)[draft], PROMPTS, max_new_tokens=budgets, num_draft_tokens=3,
                                batch_size=3, strategy=strategy, eos_token_id=EOS, check_invariants=True, **FIXED_K)
    assert result.sequences == want
    few = [w for w in widths if w < attention.SDPA_MIN_QUERIES]  # decode and verify forwards
    assert (len(few) > 0) == (backend == "cuda" or measured_sdpa), \
        "decode and verify run SDPA's kernels under fused attention, and on a CPU where SDPA measured faster"


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_prepacked_linears_and_wide_kv_only_where_the_backend_wants_them(monkeypatch, backend):
    monkeypatch.setenv("SPECBATCH_BACKEND", backend)
    target = tiny("llama", seed=31 + (backend == "cuda"), dtype=torch.float32)  # a model no other test packs
    if target.device.type != "cpu":
        pytest.skip("prepacked linears exist on the CPU only")
    specbatch.generate(target, None, PROMPTS[:2], max_new_tokens=3)
    packed = [m for m in target.modules() if m in kernels.PACKED]
    assert bool(packed) == (backend == "cpu" and kernels.available())
    from specbatch.fast.engine import Settings
    from specbatch.fast.models import ModelRunner
    from specbatch.fast.compute.slot_forward import storage_dtype
    half = tiny("llama", dtype=torch.bfloat16)
    settings = Settings(k=0, eos_ids=(), window=None, dtype=torch.bfloat16, device=half.device, fill=-1e4,
                        backend=CHOICES[backend])
    with attention.engine_attention(half):
        wide = storage_dtype(ModelRunner(half), settings)
    assert wide == (torch.float32 if backend == "cpu" else None)


@pytest.mark.parametrize("strategy,dtype", grid(strategy=["ragged", "eqspec"], dtype=["bfloat16", "float16"]))
def test_fused_attention_in_half_precision_equals_target_only_up_to_ties(monkeypatch, strategy, dtype):
    monkeypatch.setenv("SPECBATCH_BACKEND", "cuda")
    target = tiny("llama", dtype=getattr(torch, dtype))
    assert_ties_only(target, PROMPTS, strategy)
