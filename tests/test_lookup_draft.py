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


# Token trees: a lookup row's leaves are the followers of its n-gram's other occurrences

def other_followers_rule(history: list[int], matched: int, proposal: int, count: int) -> list[tuple[int, float]]:
    """The tokens after the other earlier occurrences of the last `matched` tokens, latest first,
    distinct and not the proposal, each with its share of the occurrences (at most count)."""
    last = len(history) - 1
    if not matched:
        return []
    ends = [j for j in range(last - 1, matched - 2, -1)
            if history[j - matched + 1:j + 1] == history[last - matched + 1:last + 1]]
    followers = [history[j + 1] for j in ends]
    found = []
    for token in followers:
        if token != proposal and token not in [t for t, _ in found] and len(found) < count:
            found.append((token, followers.count(token) / len(followers)))
    return found


@pytest.mark.parametrize("seed", range(8))
def test_other_followers_follow_the_rule(seed):
    from specbatch.fast.drafts.lookup_draft import latest_match, other_followers
    rng = np.random.default_rng(seed)
    rows = [rng.choice([1, 2, 3, 4], int(rng.integers(1, 40))).tolist() for _ in range(6)]
    width = max(map(len, rows)) + 2
    history = torch.full((len(rows), width), -1)
    for i, r in enumerate(rows):  # left-padded: hidden slots hold -1, as the engine's lookup sees them
        history[i, width - len(r):] = torch.tensor(r)
    last = torch.full((len(rows),), width - 1)
    proposal, matched = latest_match(history, last, 3, min_ngram=1)
    others, shares = other_followers(history, last, proposal, matched, 3, 3)
    for i, r in enumerate(rows):
        want = other_followers_rule(r, int(matched[i]), int(proposal[i]), 3)
        have = int((shares[i] > 0).sum())
        assert [(int(t), float(s)) for t, s in zip(others[i, :have], shares[i, :have])] == \
            [(t, pytest.approx(s)) for t, s in want]
        assert (others[i, have:] == proposal[i]).all() and (shares[i, have:] == 0).all()


def older_follower_prompts(target, count: int, **sampling) -> list:
    """Prompts ending in an n-gram seen 5 times before with 5 different followers, whose next token
    (as target-only decoding with these settings chooses it) is the second or third latest follower:
    the lookup proposes the latest, and the right token is one of its other followers (a leaf)."""
    rng = np.random.default_rng(0)
    chosen = [None] * count
    for _ in range(300):  # each row keeps its own sampling keys: a candidate is tried in its own slot
        candidates, wanted = [], []
        for _ in range(count):
            a, b = rng.integers(10, VOCAB, 2).tolist()
            followers = rng.choice(np.arange(10, VOCAB), 5, replace=False).tolist()
            prompt = sum((rng.integers(10, VOCAB, 3).tolist() + [a, b, f] for f in followers), []) + [a, b]
            candidates.append(prompt)
            wanted.append(followers[-3:-1])
        following = specbatch.generate(target, None, candidates, max_new_tokens=1, batch_size=count,
                                       **sampling).sequences
        for i in range(count):
            if chosen[i] is None and following[i][0] in wanted[i]:
                chosen[i] = candidates[i]
        if all(c is not None for c in chosen):
            return chosen
    raise AssertionError("no such prompts found")


def lookup_leaf_spy(monkeypatch) -> list:
    """Records (lookup rows' leaves, lookup rows' accepted leaves) of every tree round."""
    import specbatch.fast.engine as engine
    seen, real = [], engine.leaf_outcome

    def spy(proposals, accepted, spine):
        confidence, leaves_accepted = real(proposals, accepted, spine)
        rows = proposals.lookup_rows
        if proposals.leaves is not None:
            seen.append((int(proposals.leaves[rows].sum()),
                         0.0 if leaves_accepted is None else float(leaves_accepted[rows].sum())))
        return confidence, leaves_accepted
    monkeypatch.setattr(engine, "leaf_outcome", spy)
    return seen


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_lookup_rows_branch_on_earlier_matches_and_stay_exact(monkeypatch, mode):
    """With tree_branches > 1 a lookup row's tree takes the followers of its n-gram's other earlier
    occurrences as leaves (checked live: the rule's counts, I7; distinct candidates); where the right
    token is one of them the leaf is accepted, and outputs stay target-only's."""
    seen = lookup_leaf_spy(monkeypatch)
    target = tiny("llama")
    sampled = {} if mode == "greedy" else dict(temperature=0.9, sampling="coupled", seed=4)
    prompts = older_follower_prompts(target, 4, **sampled)
    draft = LookupFirstDraft(tiny("llama", layers=1, seed=5), min_match=2)
    result = specbatch.generate(target, draft, prompts, max_new_tokens=16, num_draft_tokens=4, batch_size=4,
                                tree_branches=3, check_invariants=True, **sampled)
    assert result.stats["lookup_rounds"] > 0
    assert sum(leaves for leaves, _ in seen) > 0 and sum(accepted for _, accepted in seen) >= 4
    assert result.stats["leaves_accepted"] >= sum(accepted for _, accepted in seen)  # lookup rows' and others'
    alone = specbatch.generate(target, None, prompts, max_new_tokens=16, **sampled)
    assert result.sequences == alone.sequences


def test_rejection_gives_lookup_rows_no_leaves(monkeypatch):
    """A lookup row's q is one-hot: its other followers are no draws from q, so under rejection
    sampling its tree stays its chain (proofs_notes/trees.md, T6)."""
    seen = lookup_leaf_spy(monkeypatch)
    target = tiny("llama")
    prompts = older_follower_prompts(target, 2)
    draft = LookupFirstDraft(tiny("llama", layers=1, seed=5), min_match=2)
    result = specbatch.generate(target, draft, prompts, max_new_tokens=8, num_draft_tokens=4, batch_size=2,
                                tree_branches=3, check_invariants=True, temperature=0.9, sampling="rejection",
                                seed=4, policy="goodput")
    assert result.stats["lookup_rounds"] > 0 and seen and sum(leaves for leaves, _ in seen) == 0


def test_a_lookup_leaf_that_repeats_a_candidate_is_caught(monkeypatch):
    """A lookup offering its proposal again as a leaf: the live I7 check names the repeated token."""
    import specbatch.fast.proposer as proposer
    from specbatch.invariants import InvariantError
    real = proposer.other_followers

    def repeating(history, last, proposal, matched, count, max_ngram):
        others, shares = real(history, last, proposal, matched, count, max_ngram)
        return others, torch.where(matched[:, None] > 0, torch.ones_like(shares), shares)  # every slot "found"
    monkeypatch.setattr(proposer, "other_followers", repeating)
    target = tiny("llama")
    draft = LookupFirstDraft(tiny("llama", layers=1, seed=5), min_match=2)
    with pytest.raises(InvariantError, match="repeat a token"):
        specbatch.generate(target, draft, older_follower_prompts(target, 2), max_new_tokens=8, num_draft_tokens=4,
                           batch_size=2, tree_branches=3, check_invariants=True)
