"""The distilled SmolLM2 draft committed with the package: it loads, has the documented size, and its
training log matches the weights (training/train_draft.py wrote both)."""
import json

import pytest
import torch
from transformers import DynamicCache

from specbatch.fast.loading import DISTILLED_DRAFTS, load_draft

FOLDER = DISTILLED_DRAFTS["smollm2-draft"]


def test_the_committed_draft_loads_with_the_documented_size():
    weights = FOLDER / "model.safetensors"
    assert weights.stat().st_size <= 32 * 2**20
    draft, _ = load_draft("smollm2-draft-full", target=None)
    log = json.loads((FOLDER / "training_log.json").read_text())
    parameters = sum(p.numel() for p in draft.parameters())
    assert type(draft).__name__ == "LlamaForCausalLM"
    assert parameters <= 16_000_000 and parameters == log["parameters"]
    assert draft.config.vocab_size == 49152  # SmolLM2's vocabulary
    assert (draft.config.hidden_size, draft.config.num_hidden_layers) == (log["hidden"], log["layers"])
    assert next(draft.parameters()).dtype == torch.float32  # stored as float16, loaded as float32


def test_the_default_draft_keeps_only_the_trained_tokens_in_its_head():
    full, _ = load_draft("smollm2-draft-full", target=None)
    reduced, _ = load_draft("smollm2-draft", target=None)
    trained = json.loads((FOLDER / "output_tokens.json").read_text())
    assert type(reduced).__name__ == "ReducedHeadDraft"
    assert reduced.head.weight.shape == (len(set(trained)), draft_hidden(full))
    ids = torch.tensor([[1, 504, 3287, 28, 504]])
    causal = torch.zeros(1, 1, 5, 5).masked_fill(torch.ones(5, 5).triu(1).bool(), -1e9)
    with torch.no_grad():
        small = reduced(input_ids=ids, position_ids=torch.arange(5)[None], attention_mask=causal,
                        cache=DynamicCache()).logits[0]
        whole = full(input_ids=ids, position_ids=torch.arange(5)[None], attention_mask=causal,
                     cache=DynamicCache()).logits[0]
    inside = torch.tensor(sorted(set(trained)))
    torch.testing.assert_close(small[:, inside], whole[:, inside])  # same model over the trained set
    outside = torch.ones(49152, dtype=torch.bool)
    outside[inside] = False
    assert (small[:, outside] < small[:, inside].min(dim=-1, keepdim=True).values).all()


def draft_hidden(model):
    return model.config.hidden_size


def test_the_committed_draft_runs_behind_prompt_lookup():
    draft, _ = load_draft("smollm2-draft+lookup", target=None)
    ids = torch.tensor([[1, 504, 3287, 28, 504, 3287]])
    causal = torch.zeros(1, 1, 6, 6).masked_fill(torch.ones(6, 6).triu(1).bool(), -1e9)
    with torch.no_grad():
        logits = draft(input_ids=ids, position_ids=torch.arange(6)[None], attention_mask=causal,
                       cache=DynamicCache()).logits
    assert logits.shape == (1, 6, 49152) and torch.isfinite(logits).all()
    assert logits[0, -1].argmax().item() == 28  # "504 3287" occurred before, followed by 28


def test_the_committed_feature_head_loads_on_a_target_of_smollm2s_shape():
    """`--draft smollm2-head`: the feature head of training/train_feature_head.py, on the target's own
    embedding and LM head restricted to the tokens it was trained on; its size matches its log, its
    forward is the trained net's, and a target of another width is refused by name."""
    from specbatch.fast.drafts.feature_draft import FeatureHeadNet, load_feature_net
    from specbatch.fast.loading import FEATURE_HEADS, ModelLoadError
    from tests.hf_models import tiny

    folder = FEATURE_HEADS["smollm2-head"]
    assert (folder / "weights.pt").stat().st_size <= 8 * 2**20
    log = json.loads((folder / "training_log.json").read_text())
    target = tiny("llama", layers=1, seed=0, dtype=torch.float32, vocab_size=49152, hidden_size=576,
                  intermediate_size=64, num_attention_heads=9, num_key_value_heads=3)
    head, _ = load_draft("smollm2-head", target)
    net, tokens = load_feature_net(folder)
    assert isinstance(net, FeatureHeadNet) and head.mlp
    assert sum(p.numel() for p in net.parameters()) == log["parameters"]
    assert head.head.weight.shape == (len(tokens), 576) == (log["output_tokens_trained"], 576)
    ids = torch.tensor([[1, 504, 3287, 28]])
    features = torch.randn(1, 4, 576)
    with torch.no_grad():
        out = head(ids, torch.arange(4)[None], None, DynamicCache(), features=features)
        want = net(target.get_input_embeddings()(ids), features)
    torch.testing.assert_close(out.features, want)
    assert int(out.logits[0, -1].argmax()) == tokens[int((want[0, -1] @ head.head.weight.T).argmax())]
    narrow = tiny("llama", layers=1, seed=0, dtype=torch.float32, vocab_size=49152, hidden_size=64,
                  intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ModelLoadError, match="another target"):
        load_draft("smollm2-head+lookup", narrow)
