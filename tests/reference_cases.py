"""Hypothesis strategies for reference cases: models, drafts, prompts, budgets, EOS sets."""
import numpy as np
from hypothesis import strategies as st

from specbatch.reference import ScriptedDraft, ToyLM, deviate_at, deviate_hashed

VOCAB = 24
TARGET = ToyLM(vocab_size=VOCAB, dim=12, n_layers=2, seed=11)
OTHER = ToyLM(vocab_size=VOCAB, dim=8, n_layers=1, seed=12)  # an unrelated draft: almost nothing accepted


@st.composite
def drafts(draw):
    kind = draw(st.sampled_from(["none", "random", "self", "scripted", "hashed"]))
    if kind == "none":
        return None
    if kind == "random":
        return OTHER
    if kind == "self":
        return TARGET
    if kind == "scripted":
        return ScriptedDraft(TARGET, deviate_at(draw(st.sets(st.integers(1, 90), max_size=20))))
    return ScriptedDraft(TARGET, deviate_hashed(draw(st.integers(0, 99)), draw(st.floats(0.05, 0.9))))


@st.composite
def cases(draw, max_batch=16, max_prompt=64):
    count = draw(st.integers(1, max_batch))
    uneven = draw(st.booleans())
    lengths = [draw(st.integers(1, max_prompt if uneven and i == 0 else 12)) for i in range(count)]
    pad_id = draw(st.integers(0, VOCAB - 1))
    # prompts may contain the pad id (and so the EOS id when pad == eos)
    prompts = [draw(st.lists(st.sampled_from([pad_id, *range(VOCAB)]), min_size=n, max_size=n)) for n in lengths]
    eos = draw(st.sets(st.integers(0, VOCAB - 1), max_size=3))
    if draw(st.booleans()):
        eos = eos | {pad_id}  # pad == eos
    per_request = draw(st.booleans())
    max_new = ([draw(st.integers(1, 14)) for _ in prompts] if per_request else draw(st.integers(1, 14)))
    return dict(prompts=prompts, pad_id=pad_id, eos_ids=sorted(eos), max_new_tokens=max_new,
                k=draw(st.integers(1, 8)), batch_size=draw(st.integers(1, 16)), draft=draw(drafts()))


_oracle_cache: dict = {}


def oracle(prompts, max_new_tokens, eos_ids):
    from specbatch.reference import greedy_decode
    out = []
    for i, p in enumerate(prompts):
        budget = max_new_tokens if np.isscalar(max_new_tokens) else max_new_tokens[i]
        key = (tuple(p), budget, tuple(eos_ids))
        if key not in _oracle_cache:
            _oracle_cache[key] = greedy_decode(TARGET, p, budget, eos_ids)
        out.append(_oracle_cache[key])
    return out
