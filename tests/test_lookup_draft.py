"""Prompt lookup as a draft: the vectorized lookup against a plain-Python statement of the rule on
padded batches, and the lookup drafts (alone, and in front of a model) in every strategy against
transformers' greedy decoding with the invariants checked (the token history is a cache layer)."""
import numpy as np
import pytest
import torch
from transformers import DynamicCache

import specbatch
from hf_models import EOS, VOCAB, oracle, tiny
from specbatch.fast.cache import rect_inputs
from specbatch.fast.lookup_draft import LookupFirstDraft, PromptLookupDraft, lookup

STRATEGIES = ["eqspec", "exspec", "ragged"]


def lookup_rule(history: list[int], max_ngram: int) -> tuple[int, int]:
    """The latest earlier occurrence of the last n tokens (longest n first): (next token, n)."""
    last = len(history) - 1
    for n in range(max_ngram, 0, -1):
        for j in range(last - 1, n - 2, -1):
            if history[j - n + 1:j + 1] == history[last - n + 1:last + 1]:
                return history[j + 1], n
    return history[last], 0


@pytest.mark.parametrize("seed", range(6))
def test_lookup_follows_the_rule_on_a_left_padded_batch(seed):
    rng = np.random.default_rng(seed)
    alphabet = [0, 1, 2, 3, EOS]  # small, with the pad id in it: many matches, some of them pads in content
    rows = [rng.choice(alphabet, int(rng.integers(1, 30))).tolist() for _ in range(7)]
    width = max(map(len, rows))
    pad_len = torch.tensor([width - len(r) for r in rows])
    ids = torch.tensor([[EOS] * (width - len(r)) + r for r in rows])  # the pad id is also a content token
    _, mask = rect_inputs(pad_len, 0, width, None, torch.float32, -1e9)
    proposal, matched = lookup(DynamicCache(), 0, ids, mask, max_ngram=3)
    assert list(zip(proposal.tolist(), matched.tolist())) == [lookup_rule(r, 3) for r in rows]


def repetitive_prompts():
    rng = np.random.default_rng(3)
    phrase = rng.integers(10, VOCAB, 6).tolist()
    return [phrase * 3 + rng.integers(10, VOCAB, n).tolist() + phrase[:3] for n in (1, 7, 30)] + \
        [rng.integers(0, VOCAB, 12).tolist(), [5]]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("min_match", [1, 2])
def test_lookup_in_front_of_a_model_equals_greedy(strategy, min_match):
    target = tiny("llama")
    prompts = repetitive_prompts()
    draft = LookupFirstDraft(tiny("llama", layers=1, seed=5), min_match=min_match)
    result = specbatch.generate(target, draft, prompts, max_new_tokens=14, num_draft_tokens=4, batch_size=3,
                                strategy=strategy, check_invariants=True)
    assert result.sequences == oracle(target, prompts, 14, [EOS])
    assert draft.lookup_proposals > 0  # the lookup really proposed, not only the model


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_prompt_lookup_alone_equals_greedy(strategy):
    target = tiny("qwen3")
    prompts = repetitive_prompts()
    result = specbatch.generate(target, PromptLookupDraft(VOCAB), prompts, max_new_tokens=14, num_draft_tokens=3,
                                batch_size=4, strategy=strategy, check_invariants=True)
    assert result.sequences == oracle(target, prompts, 14, [EOS])


def test_lookup_first_draft_proposes_the_copy_when_it_matches():
    """On a history whose last 2 tokens occurred before, the last logits are one-hot on the follower."""
    model = tiny("llama", layers=1, seed=5)
    draft = LookupFirstDraft(model, min_match=2)
    ids = torch.tensor([[11, 12, 13, 14, 11, 12]])
    _, mask = rect_inputs(torch.zeros(1, dtype=torch.long), 0, 6, None, torch.float64, -1e9)
    with torch.no_grad():
        logits = draft(input_ids=ids, position_ids=torch.arange(6)[None], attention_mask=mask.double(),
                       cache=DynamicCache()).logits
        plain = model(input_ids=ids, position_ids=torch.arange(6)[None], attention_mask=mask.double()).logits
    assert logits[0, -1].argmax().item() == 13 and logits[0, -1].max() - logits[0, -1].min() > 1e3
    torch.testing.assert_close(logits[0, :-1], plain[0, :-1])  # earlier positions: the model's own


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lookup_never_matches_across_the_padding(strategy, tmp_path):
    """Prompts with runs of the pad id (== EOS) in their content, next to longer prompts so that they
    are left-padded with it: every request drafts exactly what it drafts alone at batch 1 (its rows
    of the two traces agree round by round), and the output is greedy decoding."""
    target = tiny("llama")
    prompts = [[5, EOS, EOS], [9, 4, EOS, EOS, 8, EOS, EOS], list(range(10, 40)), [EOS, EOS], [3] * 25 + [EOS, EOS]]

    def drafts(batch):
        path = tmp_path / f"{strategy}-{batch}.jsonl"
        result = specbatch.generate(target, PromptLookupDraft(VOCAB), prompts, max_new_tokens=8,
                                    batch_size=batch, strategy=strategy, eos_token_id=[EOS], pad_token_id=EOS,
                                    trace=path, draft_threshold=0.0, adaptive=False)
        rounds = {}
        for line in open(path):
            obj = __import__("json").loads(line)
            for row in obj.get("rows", []):
                rounds.setdefault(row["request"], []).append(row["drafted"])
        return result.sequences, rounds

    alone_out, alone = drafts(1)
    batch_out, batched = drafts(5)
    assert alone_out == batch_out == oracle(target, prompts, 8, [EOS])
    assert batched == alone
