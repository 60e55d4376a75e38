"""bfloat16 on CPU: speculative decoding equals target-only decoding through the same forward path in
the same dtype, up to floating-point ties counted in bfloat16 ulps; the tie rule scales with the
logits' magnitude."""
import numpy as np
import pytest
import torch

import specbatch
from hf_models import VOCAB, assert_ties_only, tiny
from specbatch.fast.equivalence import TIE_ULPS, compare, ulp

RNG = np.random.default_rng(8)
PROMPTS = [RNG.integers(0, VOCAB, n).tolist() for n in (1, 25, 6, 70, 3, 12)]


def test_ulp_scales_with_the_magnitude():
    assert ulp(20.0, torch.bfloat16) == 0.125  # 16 <= 20 < 32: 2^4 x 2^-7
    assert ulp(-20.0, torch.bfloat16) == 0.125
    assert ulp(0.3, torch.bfloat16) == torch.finfo(torch.bfloat16).eps  # below 1: the spacing at 1
    assert ulp(20.0, torch.float32) == 2.0 ** -19
    assert ulp(1000.0, torch.float32) == 2.0 ** -14


@pytest.mark.parametrize("strategy", ["ragged", "eqspec", "exspec"])
def test_bfloat16_speculative_equals_target_only_up_to_bfloat16_ties(strategy):
    target = tiny("llama", dtype=torch.bfloat16)
    assert_ties_only(target, PROMPTS, strategy)


def test_an_algorithmic_divergence_in_bfloat16_is_not_called_a_tie():
    """A wrong continuation (the reference with one token replaced by a far-from-top token) is an error."""
    target = tiny("llama", dtype=torch.bfloat16)
    reference = specbatch.generate(target, None, PROMPTS, max_new_tokens=8, batch_size=1, strategy="ragged")
    broken = [list(s) for s in reference.sequences]
    with torch.inference_mode():
        logits = target(torch.tensor([PROMPTS[1] + broken[1][:3]], device=target.device)).logits[0, -1].float()
    broken[1][3] = int(logits.argmin())  # the least likely token: a margin of many ulps
    reports = compare(target, PROMPTS, broken, reference.sequences)
    assert reports[1]["exact"] is False and reports[1]["index"] == 3 and reports[1]["kind"] == "error"
    assert reports[1]["gap_ulps"] > TIE_ULPS[torch.bfloat16] >= 0
    assert all(r["exact"] for i, r in enumerate(reports) if i != 1)


def test_the_tie_rule_counts_ulps_at_the_rows_largest_logit_not_its_top(monkeypatch):
    """The rounding noise of a logit h . w follows |h| |w|, which the row's largest |logit| shows and a
    small top logit hides: SmolLM2 in bfloat16 put its top two tokens 0.164 apart (2.0 and 1.836)
    at one row count and in the other order at another, with logits down to -39.75 in the row. That
    is a tie (4 ulps at 39.75: 1.0); the same gap where every logit is small is an error."""
    import specbatch.fast.equivalence as equivalence
    target = tiny("llama", dtype=torch.bfloat16)
    row = torch.full((VOCAB,), -1.0, dtype=torch.float64)
    row[5], row[6] = 2.0, 1.8359375

    def crafted(model, prefix):
        return row.clone()
    monkeypatch.setattr(equivalence, "next_logits", crafted)
    row[7] = -39.75
    [report] = compare(target, [[1, 2]], [[6]], [[5]])
    assert report["kind"] == "tie" and report["gap"] == pytest.approx(0.1640625)
    assert report["threshold"] == 4 * ulp(39.75, torch.bfloat16) == 1.0
    row[7] = -1.0  # every logit small: 4 ulps at 2.0 is 0.0625
    [report] = compare(target, [[1, 2]], [[6]], [[5]])
    assert report["kind"] == "error" and report["threshold"] == 4 * ulp(2.0, torch.bfloat16)
