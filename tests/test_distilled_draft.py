"""The distilled SmolLM2 draft committed with the package: it loads, has the documented size, and its
training log matches the weights (training/train_draft.py wrote both)."""
import json

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
