"""The torch engine's input checks (clear ValueErrors naming the problem) and its live invariant
checks (check_invariants=True), which must catch a broken engine with the right invariant id."""
import re

import pytest
import torch

import specbatch
import specbatch.fast.strategies.eqspec as eqspec
from hf_models import EOS, FIXED_K, VOCAB, tiny
from specbatch.fast.drafts.scripted import ScriptedDraft
from specbatch.invariants import InvariantError
from specbatch.reference import deviate_hashed

PROMPTS = [[1, 2, 3], [4, EOS, 6, 7, 8, 9], [10]]


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompts=[]), "non-empty list"),
    (dict(prompts=[[1], []]), "prompt 1 is empty"),
    (dict(prompts=[[1], [VOCAB + 3]]), f"prompt 1 has token id {VOCAB + 3} outside the vocabulary"),
    (dict(prompts=["hello"]), "prompt 0 is a string; pass tokenizer="),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=[3, 3]), "max_new_tokens has 2 entries for 3 prompts"),
    (dict(num_draft_tokens=-1), "num_draft_tokens must be an integer >= 1, got -1"),
    (dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
    (dict(strategy="fastest"), "unknown strategy 'fastest'"),
    (dict(prompts=[[1] * 501]), "prompt 0: 501 prompt tokens + 8 new + 4 draft tokens exceed the target's context of 512"),
    (dict(temperature=-1.0), "temperature must be a finite number in [0.0, inf), got -1.0"),
    (dict(temperature=0.7, sampling="magic"), "unknown sampling mode"),
    (dict(temperature=0.7, top_p=1.5), "top_p must be a finite number in (0.0, 1.0], got 1.5"),
    (dict(temperature=0.7, seed=[1, 2]), "seed has 2 entries for 3 prompts"),
])
def test_bad_input_is_refused_with_a_clear_message(kwargs, message):
    args = dict(prompts=PROMPTS, max_new_tokens=8)
    args.update(kwargs)
    prompts = args.pop("prompts")
    with pytest.raises(ValueError, match=re.escape(message)):
        specbatch.generate(tiny("llama"), tiny("llama", layers=1, seed=2), prompts, **args)


def test_pair_with_different_vocabularies_is_refused():
    other = tiny("llama", layers=1, seed=2, vocab_size=VOCAB + 1)
    with pytest.raises(ValueError, match="vocabularies differ: target has 96 output tokens, draft has 97"):
        specbatch.generate(tiny("llama"), other, PROMPTS, max_new_tokens=4)


def test_mixed_sliding_and_full_layers_beyond_the_window_are_refused():
    model = tiny("qwen3", sliding_window=4, use_sliding_window=True, max_window_layers=1,
                 layer_types=("full_attention", "sliding_attention"))
    with pytest.raises(ValueError, match="mixes sliding-window"):
        specbatch.generate(model, None, PROMPTS, max_new_tokens=8)


def _broken_positions(monkeypatch):
    original = eqspec.rect_inputs

    def rect_inputs(pad_len, first_col, num_cols, window, dtype, fill):  # positions counted from column 0
        pos, mask = original(pad_len, first_col, num_cols, window, dtype, fill)
        return pos + pad_len[:, None], mask
    monkeypatch.setattr(eqspec, "rect_inputs", rect_inputs)


def _mask_from_pad_id(monkeypatch):
    """Hide every slot whose token equals the pad id (== EOS here), as `tokens != pad_id` masks do."""
    def forward(self, runner, ids, first_col, cache, last_only=False):
        hidden = torch.zeros(self.size, first_col + ids.shape[1], dtype=torch.bool)
        width = min(self.width, hidden.shape[1])
        hidden[:, :width] = self.tokens[:, :width] == EOS
        s = self.settings
        pos, mask = eqspec.rect_inputs(self.pad_len_t, first_col, ids.shape[1], s.window, s.dtype, s.fill)
        mask = mask.masked_fill(hidden[:, None, None, :], s.fill)
        s.observer.check(lambda: eqspec.check_rect_forward(self.pad_len_t, first_col, pos, mask, s.window))
        return runner(ids, pos, mask, cache, last_only=last_only), pos, mask
    monkeypatch.setattr(eqspec.RectBatch, "forward", forward)


def _skip_realignment(monkeypatch):
    """Crop instead of gather: rows keep stale slots where their content should have moved."""
    original = eqspec.gather_cache
    monkeypatch.setattr(eqspec, "gather_cache", lambda cache, rows, source, width: original(cache, rows, None, width))


def _no_bonus(monkeypatch):
    original = eqspec.commit_counts

    def commit_counts(choice, accepted, remaining, eos):
        n, hit = original(choice, accepted, remaining, eos)
        return torch.where(accepted == choice.shape[1] - 1, torch.minimum(n, accepted), n), hit
    monkeypatch.setattr(eqspec, "commit_counts", commit_counts)


@pytest.mark.parametrize("mutant,invariant", [(_broken_positions, "I2"), (_mask_from_pad_id, "I4"),
                                              (_skip_realignment, "I3"), (_no_bonus, "I5")])
def test_check_invariants_names_the_broken_invariant(monkeypatch, mutant, invariant):
    target = tiny("llama")
    draft = target if mutant is _no_bonus else ScriptedDraft(target, deviate_hashed(1, 0.4))
    mutant(monkeypatch)
    with pytest.raises(InvariantError) as caught:
        specbatch.generate(target, draft, PROMPTS, max_new_tokens=10, num_draft_tokens=3, check_invariants=True,
                           strategy="eqspec", **FIXED_K)  # the mutants are in eqspec's code
    v = caught.value.violations[0]
    assert v.invariant == invariant and v.round is not None and v.row is not None, str(caught.value)


@pytest.mark.parametrize("broken", ["bsp-like", "dsd-like"])
def test_deliberately_broken_variants_collapse_and_are_caught(broken):
    """The bench's correctness table relies on these reproducing the published mistakes."""
    import numpy as np
    from hf_models import oracle
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (1, 9, 30, 3, 12, 2)]
    target = tiny("llama")
    draft = ScriptedDraft(target, deviate_hashed(2, 0.3))
    from specbatch.api import generate_variant
    result = generate_variant(target, draft, prompts, max_new_tokens=12, num_draft_tokens=3, batch_size=6,
                              variant=broken, **FIXED_K)
    want = oracle(target, prompts, 12, [EOS])
    assert sum(a == b for a, b in zip(result.sequences, want)) <= len(prompts) // 2
    with pytest.raises(InvariantError):
        generate_variant(target, draft, prompts, max_new_tokens=12, num_draft_tokens=3, batch_size=6,
                         variant=broken, check_invariants=True, **FIXED_K)
    with pytest.raises(ValueError, match="unknown strategy"):  # never through the public API
        specbatch.generate(target, draft, prompts, max_new_tokens=12, strategy=broken)


@pytest.mark.parametrize("strategy", ["eqspec", "exspec", "ragged"])
def test_unwatched_rounds_compute_nothing_for_checks_or_traces(monkeypatch, strategy):
    """Without check_invariants or trace the observer is the null one: no check, trace row, query
    layout or row contents is computed (each would raise here), and the output is unchanged."""
    import specbatch.fast.strategies.ragged as ragged
    from specbatch.fast.observer import InvariantChecker, Observer, Observers, TraceRecorder, observer_for

    def never(*args, **kwargs):
        raise AssertionError("computed for nobody")
    for module, name in ((eqspec, "rect_queries"), (ragged, "rect_queries"), (ragged, "flat_queries"),
                         (eqspec, "check_rect_forward"), (eqspec, "check_alignment"), (ragged, "check_conservation")):
        monkeypatch.setattr(module, name, never)
    monkeypatch.setattr(ragged.RaggedEngine, "_contents", never)
    target = tiny("llama")
    draft = ScriptedDraft(target, deviate_hashed(2, 0.3))
    plain = specbatch.generate(target, draft, PROMPTS, max_new_tokens=8, num_draft_tokens=3, batch_size=2,
                               strategy=strategy, **FIXED_K)
    monkeypatch.undo()
    watched = specbatch.generate(target, draft, PROMPTS, max_new_tokens=8, num_draft_tokens=3, batch_size=2,
                                 strategy=strategy, check_invariants=True, **FIXED_K)
    assert plain.sequences == watched.sequences
    assert type(observer_for(False, None)) is Observer and type(observer_for(True, None)) is InvariantChecker
    both = observer_for(True, object())
    assert isinstance(both, Observers) and [type(o) for o in both.observers] == [InvariantChecker, TraceRecorder]


def test_the_checker_raises_what_a_round_reported_at_its_end_and_starts_afresh():
    from specbatch.fast.observer import InvariantChecker
    from specbatch.invariants import Violation
    checker = InvariantChecker()
    checker.check(lambda: [])
    checker.check(lambda: [Violation("I4", "a query sees a pad", row=1)])
    with pytest.raises(InvariantError) as caught:
        checker.end_round(3)
    assert caught.value.invariant == "I4"
    checker.end_round(4)  # nothing reported since: the round passes
