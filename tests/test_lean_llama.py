"""fast.compute.lean_llama: the draft's lean forward computes the Llama model's own function (up to rounding)
through any cache, and a draft using it keeps the engine exact in every strategy."""
import copy

import pytest
import torch
from transformers import DynamicCache

import specbatch
from specbatch.fast.compute.lean_llama import LeanLlama, rotary_angles, rotate, supported
from specbatch.fast.drafts.reduced_head import ReducedHeadDraft

from hf_models import EOS, FIXED_K, VOCAB, oracle, tiny


def causal(queries: int, slots: int) -> torch.Tensor:
    """The additive mask of `queries` new tokens after slots - queries cached ones."""
    q = torch.arange(slots - queries, slots)[:, None]
    return torch.zeros(1, 1, queries, slots, dtype=torch.float64).masked_fill(torch.arange(slots)[None] > q, -1e9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_rotation_is_transformers_apply_rotary_pos_emb_bitwise(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    model = tiny("llama", layers=1, seed=2).to(dtype)
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, 4, 3, 8, generator=g).to(dtype) for _ in range(2))  # [B, Q, heads, D]
    position_ids = torch.tensor([[0, 7, 30, 511], [3, 4, 5, 6]])
    cos, sin = model.model.rotary_emb(q, position_ids)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    cos4, signed_sin = rotary_angles(model.model.rotary_emb, q, position_ids)
    assert torch.equal(rotate(q, cos4, signed_sin), want_q) and torch.equal(rotate(k, cos4, signed_sin), want_k)


@pytest.mark.parametrize("heads", [(4, 2), (4, 4)])
def test_the_lean_forward_equals_the_model_through_a_growing_cache(heads):
    model = tiny("llama", layers=2, seed=3, num_attention_heads=heads[0], num_key_value_heads=heads[1])
    lean = LeanLlama(model)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    theirs, ours = DynamicCache(), DynamicCache()
    with torch.no_grad():
        for start, end in ((0, 6), (6, 7), (7, 9)):  # a prompt, one step, two steps: the cache is read back
            pos = torch.arange(start, end)[None].expand(2, -1)
            mask = causal(end - start, end)
            want = model.model(input_ids=ids[:, start:end], position_ids=pos, attention_mask=mask, cache=theirs,
                               use_cache=True).last_hidden_state
            got = lean(ids[:, start:end], pos, mask, ours)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the model's norms round to float32
    for layer in range(2):
        torch.testing.assert_close(ours.layers[layer].keys, theirs.layers[layer].keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.layers[layer].values, theirs.layers[layer].values, rtol=1e-5, atol=1e-5)


def test_only_plain_llama_models_get_the_lean_forward():
    assert supported(tiny("llama"))
    assert not supported(tiny("qwen3"))  # q/k norms
    assert not supported(tiny("llama", attention_bias=True))
    scaled = copy.deepcopy(tiny("llama"))
    scaled.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert not supported(scaled)
    assert ReducedHeadDraft(tiny("llama", seed=1), range(VOCAB)).lean is not None
    assert ReducedHeadDraft(tiny("qwen3", seed=1), range(VOCAB)).lean is None


@pytest.mark.parametrize("strategy", ["ragged", "eqspec", "exspec"])
def test_a_lean_draft_keeps_generation_exact(strategy):
    target = tiny("llama", layers=2, seed=0)
    draft = ReducedHeadDraft(tiny("llama", layers=1, seed=5), range(0, VOCAB, 2))
    prompts = [[1, 5, 9, 4], [3, 3], [8, 2, 6, 1, 9, 9, 4]]
    result = specbatch.generate(target, draft, prompts, max_new_tokens=12, batch_size=2, strategy=strategy,
                                eos_token_id=[EOS], check_invariants=True, **FIXED_K)
    assert result.sequences == oracle(target, prompts, 12, [EOS])
    assert result.stats["drafted_tokens"] > 0
