"""Prompt lookup as a draft: the vectorized lookup against a plain-Python statement of the rule on
padded batches, and the lookup drafts (alone, and in front of a model) in every strategy against
transformers' greedy decoding with the invariants checked (the token history is a cache layer)."""
import numpy as np
import pytest
import torch
from transformers import DynamicCache

import specbatch
from specbatch.fast.policy import Threshold
from hf_models import EOS, VOCAB, oracle, tiny
from specbatch.fast.compute.cache import rect_inputs
from specbatch.fast.drafts.lookup_draft import LookupFirstDraft, PromptLookupDraft, lookup

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
                                    trace=path, draft_threshold=0.0, policy="threshold")
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


@pytest.mark.parametrize("batch_size", [1, 3])
def test_lookup_rows_draft_without_the_model_and_stay_exact(batch_size):
    """ragged: a row whose lookup matches at the start of a round drafts by lookup alone; rounds of
    such rows only run no draft forward (lookup_rounds), and the draft's cache catches up later (I3
    checks it against a fresh prefill every round)."""
    target = tiny("llama")
    prompts = repetitive_prompts()
    draft = LookupFirstDraft(tiny("llama", layers=1, seed=5), min_match=2)
    kwargs = dict(max_new_tokens=14, num_draft_tokens=4, batch_size=batch_size, strategy="ragged")
    result = specbatch.generate(target, draft, prompts, check_invariants=True, **kwargs)
    assert result.sequences == oracle(target, prompts, 14, [EOS])
    assert result.stats["lookup_rounds"] > 0
    fixed = specbatch.generate(target, draft, prompts, draft_threshold=0.0, policy="threshold", **kwargs)
    assert fixed.stats["lookup_rounds"] == 0  # no threshold: every row drafts k from the model as before
    assert result.stats["draft_tokens_processed"] < fixed.stats["draft_tokens_processed"]


def test_lookup_rows_keep_coupled_sampling_exact():
    target = tiny("llama")
    prompts = repetitive_prompts()
    draft = LookupFirstDraft(tiny("llama", layers=1, seed=5), min_match=2)
    kwargs = dict(max_new_tokens=14, batch_size=3, strategy="ragged", temperature=0.8, sampling="coupled", seed=4)
    result = specbatch.generate(target, draft, prompts, num_draft_tokens=4, check_invariants=True, **kwargs)
    assert result.stats["lookup_rounds"] > 0
    assert result.sequences == specbatch.generate(target, None, prompts, **kwargs).sequences


class FakeLookup:
    """lookup_step for draft_round: row r's lookup proposes token 20 + r at the steps in matches[r]."""

    def __init__(self, matches, vocab=40):
        self.matches, self.vocab = matches, vocab

    def __call__(self, step, ids):
        from specbatch.fast.drafts.lookup_draft import LookupStep
        rows = len(self.matches)
        matched = torch.tensor([2 * (step in m) for m in self.matches])
        return LookupStep(20 + torch.arange(rows), matched, self.vocab)


def run_draft_round(matches, model_confident_steps, k=4):
    """draft_round on fakes: the model proposes token 7 while step < model_confident_steps[r], then
    nothing it is sure of; returns (proposals, model calls)."""
    from specbatch.fast.engine import Settings, draft_round
    calls, needs = [], []
    confident = torch.tensor(model_confident_steps)

    def step_forward(step, ids, needed):
        calls.append(step)
        needs.append(needed.tolist())
        logits = torch.zeros(len(confident), 40)
        logits[:, 7] = torch.where(confident > step, 100.0, 0.0)
        return logits

    settings = Settings(k=k, eos_ids=(), window=None, dtype=torch.float32, device=torch.device("cpu"), fill=-1e9,
                        policy=Threshold(k, 0.5, None))
    rows = len(matches)
    proposals = draft_round(step_forward, settings, np.full(rows, k), torch.arange(rows),
                            torch.zeros(rows, dtype=torch.long), "cpu", FakeLookup(matches))
    proposals.needed = needs  # per model step, the rows whose logits were read
    return proposals, calls


def test_draft_round_lookup_rows_follow_their_own_chain():
    # row 0: lookup matches for 3 steps; row 1: no match at step 0, so the model drafts it (2 sure steps)
    proposals, calls = run_draft_round([{0, 1, 2}, set()], [4, 2])
    assert proposals.proposed.tolist() == [3, 2]
    assert proposals.drafted[0, :3].tolist() == [20, 20, 20] and proposals.drafted[1, :2].tolist() == [7, 7]
    assert calls == [0, 1, 2] and proposals.model_steps == 3  # the model runs while row 1 may still draft
    # a row that matches only from step 1 on is a model row for the whole round, which takes the lookup's
    # token where it matches (the lookup-first draft's rule: the engine looks up for the draft); a lookup
    # row whose chain breaks stops even where the model is sure (and a later match does not restart it)
    proposals, calls = run_draft_round([{0, 2}, {1, 2}, set()], [4, 3, 0])
    assert proposals.proposed.tolist() == [1, 3, 0]
    assert proposals.drafted[1, :3].tolist() == [7, 21, 21] and calls == [0, 1, 2, 3]  # step 3: row 1 unsure
    # the model's logits are read in the model rows still drafting, also where the lookup gives the
    # token (a feature head needs that step's estimate next), never in a lookup row or a stopped row
    assert proposals.needed == [[False, True, True], [False, True, False], [False, True, False],
                                [False, True, False]]


def test_draft_round_of_lookup_rows_alone_runs_no_model():
    proposals, calls = run_draft_round([{0, 1}, {0, 1, 2, 3}], [4, 4])
    assert calls == [] and proposals.model_steps == 0
    assert proposals.proposed.tolist() == [2, 4]  # each stops where its own chain breaks
    assert proposals.drafted[1].tolist() == [21] * 4


def test_one_hot_where_matched_leaves_unmatched_rows_alone():
    """Matched rows become one-hot on their proposal; a row without a match keeps its logits, so
    its confidence stays the model's (or uniform for lookup rows, which then stop proposing)."""
    from specbatch.fast.drafts.lookup_draft import one_hot_where_matched
    logits = torch.randn(3, 10)
    before = logits.clone()
    out = one_hot_where_matched(logits, torch.tensor([4, 7, 2]), torch.tensor([2, 0, 3]))
    torch.testing.assert_close(out[1], before[1])
    for row, token in ((0, 4), (2, 2)):
        assert out[row].argmax().item() == token and out[row, token] == 0 and out[row].min() == -1e4


@pytest.mark.parametrize("vocab", [40, 49152])
def test_greedy_drafts_a_lookup_step_as_it_drafts_its_logits(vocab):
    """Greedy.draft_lookup (no [R, V] logits) returns exactly what Greedy.draft returns for the
    step's one-hot / uniform logits: the proposal with probability 1 where a row matched, token 0
    with probability 1 / V where it did not (such a row then stops proposing)."""
    from specbatch.fast.drafts.lookup_draft import LookupStep
    from specbatch.fast.sampling import Greedy
    g = torch.Generator().manual_seed(vocab)
    step = LookupStep(torch.randint(1, vocab, (9,), generator=g), torch.tensor([0, 2, 3, 0, 1, 2, 0, 3, 2]), vocab)
    requests, positions = torch.arange(9), torch.full((9,), 5)
    token, dist, confidence = Greedy().draft_lookup(step, requests, positions)
    want_token, want_dist, want_confidence = Greedy().draft(step.logits(), requests, positions)
    assert dist is None and want_dist is None
    assert torch.equal(token, want_token) and torch.equal(confidence, want_confidence)
    assert token[step.matched == 0].eq(0).all() and confidence[step.matched == 0].lt(0.5).all()


@pytest.mark.parametrize("reduced,policy", [(False, "threshold"), (True, "threshold"), (False, "goodput")])
def test_ragged_proposals_behind_a_lookup_are_the_lookup_first_drafts_own(tmp_path, monkeypatch, reduced, policy):
    """The ragged engine runs the prompt lookup itself (lookup rows; engine_lookup=True, so the draft
    skips its own), and a restricted head's logits stay restricted there (SubsetLogits). Every traced
    proposal and its confidence must still be the lookup-first draft's, run from scratch over the
    row's content and earlier proposals: the model's token and confidence where no n-gram matches,
    the lookup's token (confidence 1) where one does, in lookup rows and model rows alike, under the
    threshold rule and the goodput rule (its prices at 0, so that every row drafts whatever the
    machine's timings)."""
    import json
    from specbatch.fast.compute.cache import rect_inputs
    from specbatch.fast.policy import Goodput
    from specbatch.fast.proposals import GoodputRule
    from specbatch.fast.drafts.reduced_head import ReducedHeadDraft
    target = tiny("llama")
    model = tiny("llama", layers=1, seed=5)
    inner = ReducedHeadDraft(model, range(0, VOCAB, 2)) if reduced else model  # even tokens only
    draft = LookupFirstDraft(inner)
    prompts = repetitive_prompts()
    path = tmp_path / "trace.jsonl"
    ones = lambda info: np.ones(len(info.clamp))  # noqa: E731
    monkeypatch.setattr(Goodput, "plan", lambda self, info: GoodputRule(info.clamp, ones(info), ones(info),
                                                                        ones(info), 0.0, 0.0))
    result = specbatch.generate(target, draft, prompts, max_new_tokens=14, num_draft_tokens=4, batch_size=3,
                                draft_threshold=0.01, trace=path, check_invariants=True, policy=policy)
    assert result.sequences == oracle(target, prompts, 14, [EOS])
    counts = {"lookup": 0, "model": 0}
    with torch.no_grad():
        for round_ in [json.loads(line) for line in open(path)][1:-1]:
            for row in round_["rows"]:
                assert ("bar" in row) == (policy == "goodput")
                ids = row["tokens"][:row["content_len"]]
                for proposal, confidence in zip(row["drafted"], row["draft_confidence"]):
                    pos, mask = rect_inputs(torch.zeros(1, dtype=torch.long), 0, len(ids), None, torch.float64, -1e9)
                    logits = draft(torch.tensor([ids]), pos, mask, DynamicCache()).logits[0, -1]
                    assert int(logits.argmax()) == proposal
                    assert confidence == pytest.approx(float(torch.softmax(logits.float(), -1).max()), rel=1e-5)
                    counts["lookup" if confidence == 1.0 else "model"] += 1
                    ids = ids + [proposal]
    assert counts["lookup"] >= 10 and counts["model"] >= 10


@pytest.mark.parametrize("vocab", [VOCAB, 49152])
def test_prompt_lookup_confidence_grows_with_the_matched_ngram(vocab):
    """The draft's probability of its proposal (what the proposal rules read as confidence): about 1
    for a match of 2+ tokens, 0.2 for a single-token match, 1.5 / V without a match (barely above
    uniform, so that such a row stops proposing)."""
    rows = [[5, 6, 7, 5, 6], [5, 9, 8, 5], [1, 2, 3, 4]]  # matched 2, 1 and 0 tokens
    width = max(map(len, rows))
    pad_len = torch.tensor([width - len(r) for r in rows])
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    _, mask = rect_inputs(pad_len, 0, width, None, torch.float32, -1e9)
    draft = PromptLookupDraft(vocab)
    probs = draft(input_ids=ids, attention_mask=mask, cache=DynamicCache(), logits_to_keep=1).logits[:, -1].softmax(-1)
    proposal, matched = lookup(DynamicCache(), 0, ids, mask, max_ngram=3)
    assert matched.tolist() == [2, 1, 0] and proposal.tolist()[:2] == [7, 9]
    chosen = probs.gather(1, proposal[:, None])[:, 0].tolist()
    assert chosen[0] == pytest.approx(1.0, abs=1e-6)
    assert chosen[1] == pytest.approx(0.2, rel=1e-4) and chosen[2] == pytest.approx(1.5 / vocab, rel=1e-4)
