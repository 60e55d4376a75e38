"""The draft-only replay of greedy speculative decoding takes exactly the rounds the engine takes."""
import pytest
import torch

import specbatch
from hf_models import VOCAB, tiny
from specbatch.fast.acceptance import simulate_rounds
from specbatch.fast.drafts.lookup_draft import LookupFirstDraft


@pytest.mark.parametrize("lookup, threshold, floor", [(False, 0.0, 0.0), (True, 0.0, 0.0), (False, 0.3, 0.3),
                                                      (True, 0.3, 0.3), (False, 0.3, 0.0)])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_replayed_rounds_equal_the_engine_rounds(k, lookup, threshold, floor):
    """Fixed k (threshold 0) and the proposal rule without the cost controller (threshold 0.3: the
    lookup's proposals pass it, the tiny random model's never do; floor 0: the model's token at the
    step that stops a row is proposed all the same). Not with lookup and a floor below the threshold:
    where a lookup row's chain of matches breaks, the engine's lookup step is uniform, the replay
    reads the model."""
    target = tiny("llama")
    draft = tiny("llama", layers=1, seed=5)
    draft = LookupFirstDraft(draft, min_match=1) if lookup else draft
    g = torch.Generator().manual_seed(k)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 40, 9)]
    prompts[1] = prompts[1][:8] * 2 + prompts[1][8:]  # something to look up
    result = specbatch.generate(target, draft, prompts, max_new_tokens=20, num_draft_tokens=k, batch_size=2,
                                strategy="ragged", eos_token_id=[], draft_threshold=threshold, draft_floor=floor,
                                policy="threshold")
    replayed = [simulate_rounds(draft, p, a, k, threshold, floor) for p, a in zip(prompts, result.sequences)]
    assert replayed == [(len(a), r["rounds"]) for a, r in zip(result.sequences, result.request_stats)]
