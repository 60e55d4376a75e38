"""fast.drafts.feature_draft: the feature draft computes its training function through any cache, the ragged
engine feeds it the target's true features (buffer, pending tokens, f^ past the content), and
generation stays exact; strategies that cannot keep features refuse it."""
import functools
import json

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import specbatch
from specbatch.fast.policy import Goodput
from specbatch.fast.proposals import GoodputRule
from specbatch.fast.engine import Settings, Stats
from specbatch.fast.drafts.feature_draft import (FeatureBuffer, FeatureDraft, FeatureDraftNet, FeatureHeadNet,
                                          draft_pending_after_features, feature_draft_config, feature_head_config)
from specbatch.fast.drafts.lookup_draft import LookupFirstDraft
from specbatch.fast.drafts.reduced_head import ReducedHeadDraft

from hf_models import EOS, VOCAB, oracle, tiny

PROMPTS = [[5, 9, 14, 3, 22], [40, 41], [8, 8, 8, 8, 8, 8, 8, 8, 30], [61, 2, 77, 19, 19, 4, 1], [12]]


def feature_draft(target, seed=0, tokens=None, head=False):
    """A random-initialised feature draft for `target` (its features are real: the target's own);
    head: the feature head (an MLP, no decoder layer) instead."""
    torch.manual_seed(seed)
    net = FeatureHeadNet(feature_head_config(target.config, 48)) if head else \
        FeatureDraftNet(feature_draft_config(target.config))
    with torch.no_grad():
        for p in net.parameters():  # larger than the default init: distinct, confident proposals
            p.add_(torch.randn_like(p) * 0.3)
    return FeatureDraft(target, net, range(VOCAB) if tokens is None else tokens).eval(), net


def conditioned_draft(target, seed=0, arch="llama"):
    """A token draft (another tiny model) that also reads the target's features through a projection."""
    generator = torch.Generator().manual_seed(seed)
    projection = torch.randn(32, target.config.hidden_size, generator=generator, dtype=torch.float64) * 0.5
    return ReducedHeadDraft(tiny(arch, layers=1, seed=seed + 10), range(VOCAB), projection).eval()


DRAFTS = {"feature": lambda target, seed: feature_draft(target, seed)[0],
          "head": lambda target, seed: feature_draft(target, seed, head=True)[0],
          "conditioned": lambda target, seed: conditioned_draft(target, seed)}


def causal(queries: int, slots: int) -> torch.Tensor:
    q = torch.arange(slots - queries, slots)[:, None]
    return torch.zeros(1, 1, queries, slots, dtype=torch.float64).masked_fill(torch.arange(slots)[None] > q, -1e9)


@pytest.mark.parametrize("head", [False, True])
def test_the_engine_forward_equals_the_training_forward_through_a_growing_cache(head):
    target = tiny("llama", layers=2, seed=4)
    draft, net = feature_draft(target, seed=1, tokens=range(0, VOCAB, 3), head=head)  # net: float64 like the target
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    features = torch.randn(2, 9, target.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        want = net(target.get_input_embeddings()(ids), features, torch.arange(9)[None].expand(2, -1))
        cache, got = DynamicCache(), []
        for start, end in ((0, 6), (6, 7), (7, 9)):  # a prefill, then steps reading the cache back
            out = draft(ids[:, start:end], torch.arange(start, end)[None].expand(2, -1), causal(end - start, end),
                        cache, features=features[:, start:end])
            got.append(out)
    # (transformers' norms round to float32 inside; the lean block's do not)
    torch.testing.assert_close(torch.cat([o.features for o in got], dim=1), want, rtol=1e-5, atol=1e-5)
    logits = torch.cat([o.logits for o in got], dim=1)
    head = target.get_output_embeddings().weight
    trained = torch.arange(0, VOCAB, 3)
    torch.testing.assert_close(logits[..., trained], want @ head[trained].T, rtol=1e-5, atol=1e-5)
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[trained] = False
    assert (logits[..., others] < -1e30).all()  # outside the trained tokens: never proposed


def test_the_buffer_reads_the_feature_before_each_index():
    buffer = FeatureBuffer(2, 6, 3, torch.float64, "cpu")
    rows, index = torch.tensor([[1, 1, 1]]), torch.tensor([[0, 1, 2]])
    buffer.write(rows, index, torch.arange(9, dtype=torch.float64).view(1, 3, 3))
    buffer.write(torch.tensor([0]), torch.tensor([-1]), torch.ones(1, 3))  # negative index: padding, skipped
    got = buffer.inputs(torch.tensor([1, 1, 1]), torch.tensor([0, 1, 3]))
    assert got[0].abs().sum() == 0  # index 0 reads no feature
    assert got[1].tolist() == [0, 1, 2] and got[2].tolist() == [6, 7, 8]
    assert buffer.data[0].abs().sum() == 0


def test_pending_after_a_round_counts_every_token_whose_draft_kv_came_from_estimates():
    pending = np.array([1, 3, 2])
    assert draft_pending_after_features(np.array([1, 4, 2]), 2, pending).tolist() == [1, 4, 2]
    assert draft_pending_after_features(np.array([1, 4, 2]), 0, pending).tolist() == [2, 7, 4]  # no draft step ran


def run_with_trace(tmp_path, target, draft, batch_size, max_new, **options):
    path = tmp_path / f"trace_{batch_size}.jsonl"
    out = specbatch.generate(target, draft, PROMPTS, max_new_tokens=max_new, batch_size=batch_size, trace=path,
                             check_invariants=True, eos_token_id=[EOS], **options)
    return out, [json.loads(line) for line in open(path)][1:-1]


def test_the_feature_head_computes_a_subset_of_rows_as_the_whole_batch_does():
    """forward(rows=...) gives the computed rows what the whole batch's forward gives them (logits
    and feature estimates), and zeros elsewhere; a feature draft with a decoder layer (K/V)
    refuses it."""
    target = tiny("llama", layers=2, seed=4)
    draft, _ = feature_draft(target, seed=1, tokens=range(0, VOCAB, 3), head=True)
    ids = torch.randint(0, VOCAB, (5, 3), generator=torch.Generator().manual_seed(0))
    features = torch.randn(5, 3, target.config.hidden_size, dtype=torch.float64)
    rows = torch.tensor([1, 3, 4])
    with torch.no_grad():
        whole = draft(ids, features=features, logits_to_keep=1, subset_logits=True)
        part = draft(ids, features=features, logits_to_keep=1, subset_logits=True, rows=rows)
    assert draft.computes_row_subset and LookupFirstDraft(draft).computes_row_subset
    # (equal up to rounding: a matrix product's blocking, hence its rounding, depends on its row count)
    torch.testing.assert_close(part.logits.values[rows], whole.logits.values[rows], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(part.features[rows], whole.features[rows], rtol=1e-12, atol=1e-12)
    for skipped in (0, 2):
        assert not part.logits.values[skipped].any() and not part.features[skipped].any()
    decoder, _ = feature_draft(target, seed=1)
    assert not decoder.computes_row_subset
    with pytest.raises(ValueError, match="subset of rows"):
        decoder(ids, torch.arange(3)[None].expand(5, -1), causal(3, 3), DynamicCache(), features=features, rows=rows)


@pytest.mark.parametrize("kind", sorted(DRAFTS))
@pytest.mark.parametrize("batch_size,lookup", [(1, False), (3, False), (3, True)])
def test_each_proposal_is_the_draft_run_fresh_over_the_row_with_the_targets_true_features(tmp_path, monkeypatch,
                                                                                        batch_size, kind, lookup):
    """Every proposal in the trace equals what the draft computes from scratch: the target's features
    of the row's content (a fresh forward), the draft over the content with f_{j-1} at index j, then
    over each earlier proposal with its own estimate (the conditioned draft: zero). Stale K/V from
    estimates, a pending token fed the wrong feature or a feature written at the wrong index all
    change some proposal. lookup: behind a prompt lookup, which the ragged engine then runs itself
    (lookup rows, and the lookup's token in a model row where it matches: engine.draft_round); from
    scratch it is the lookup-first draft's own."""
    target = tiny("llama", layers=2, seed=5)
    draft = DRAFTS[kind](target, 2)
    draft = LookupFirstDraft(draft) if lookup else draft
    max_new = [14, 9, 17, 6, 12]
    options = dict(draft_threshold=0.01, policy="threshold") if lookup else dict(policy="goodput")
    rounds_planned = []

    def every_third_round_plain(self, info):  # the goodput rule at price 0, and a plain round every third
        rounds_planned.append(len(info.clamp))  # (the draft's pending tokens grow there)
        plain = len(rounds_planned) % 3 == 0
        ones = np.ones(len(info.clamp))
        return GoodputRule(np.zeros_like(info.clamp) if plain else info.clamp, ones, ones, ones, 0.0, 0.0)
    monkeypatch.setattr(Goodput, "plan", every_third_round_plain)
    computed = []  # rows the feature head computed at each step (only those still drafting by the model)
    head = draft.model if lookup else draft
    forward = head.forward

    @functools.wraps(forward)  # the engine reads the forward's signature
    def spy(*args, rows=None, **kwargs):
        computed.append(None if rows is None else len(rows))
        return forward(*args, rows=rows, **kwargs)
    head.forward = spy
    out, rounds = run_with_trace(tmp_path, target, draft, batch_size, max_new, num_draft_tokens=3, **options)
    assert out.sequences == oracle(target, PROMPTS, max_new, [EOS])
    if kind == "head" and batch_size > 1:  # the proposals checked below include steps of some rows only
        assert any(n is not None for n in computed)
    else:
        assert all(n is None for n in computed)
    checked = 0
    with torch.no_grad():
        for round_ in rounds:
            for row in round_["rows"]:
                content = row["tokens"][:row["content_len"]]
                drafted = row["drafted"]
                if not drafted:
                    continue
                features = torch.zeros(1, 1, target.config.hidden_size, dtype=torch.float64)  # index 0 reads none
                if len(content) > 1:
                    hidden = target.model(input_ids=torch.tensor([content[:-1]])).last_hidden_state
                    features = torch.cat([features, hidden], dim=1)
                ids = list(content)
                for proposal in drafted:
                    n = len(ids)
                    step = draft(torch.tensor([ids]), torch.arange(n)[None], causal(n, n), DynamicCache(),
                                 features=features)
                    assert int(step.logits[0, -1].argmax()) == proposal
                    estimate = step.features[:, -1:] if step.features is not None else torch.zeros_like(features[:, :1])
                    features = torch.cat([features, estimate], dim=1)
                    ids.append(proposal)
                    checked += 1
    assert checked >= 12


def test_the_feature_buffer_holds_the_targets_features_of_each_finished_row():
    from specbatch.fast.engine import Clock
    from specbatch.fast.models import ModelRunner, mask_fill_value
    from specbatch.fast.strategies.ragged import RaggedEngine
    target = tiny("llama", layers=2, seed=6)
    draft, _ = feature_draft(target, seed=3)
    settings = Settings(k=3, eos_ids=(), window=None, dtype=torch.float64, device=torch.device("cpu"),
                        fill=mask_fill_value(torch.float64))
    stats = Stats()
    engine = RaggedEngine(ModelRunner(target), ModelRunner(draft), PROMPTS, [10] * len(PROMPTS), settings, stats,
                          Clock(stats, settings.device), slots=2)
    seen = []

    def on_done(request, tokens, reason, rounds):
        slot = int(np.nonzero(engine.request == request)[0][0])
        content = PROMPTS[request] + tokens
        want = target.model(input_ids=torch.tensor([content[:-1]])).last_hidden_state[0]
        torch.testing.assert_close(engine.proposer.features.data[slot, :len(content) - 1], want, rtol=1e-7, atol=1e-9)
        seen.append(request)

    with torch.no_grad():
        engine.run(on_done)
    assert sorted(seen) == list(range(len(PROMPTS)))
    assert not target.model.norm._forward_hooks  # the engine removed its hook


@pytest.mark.parametrize("kind", sorted(DRAFTS))
@pytest.mark.parametrize("strategy", ["eqspec", "exspec"])
def test_strategies_that_cannot_keep_features_refuse_a_feature_draft(strategy, kind):
    target = tiny("llama", layers=2, seed=5)
    draft = DRAFTS[kind](target, 0)
    with pytest.raises(ValueError, match="only strategy='ragged'"):
        specbatch.generate(target, draft, PROMPTS, max_new_tokens=4, strategy=strategy)
    with pytest.raises(ValueError, match="only strategy='ragged'"):
        specbatch.generate(target, LookupFirstDraft(draft), PROMPTS, max_new_tokens=4, strategy=strategy)


@pytest.mark.parametrize("kind", sorted(DRAFTS))
@pytest.mark.parametrize("lookup", [False, True])
@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_generation_with_a_feature_draft_is_exact(lookup, batch_size, kind):
    target = tiny("llama", layers=2, seed=7)
    draft = DRAFTS[kind](target, 4)
    draft = LookupFirstDraft(draft) if lookup else draft
    out = specbatch.generate(target, draft, PROMPTS, max_new_tokens=16, batch_size=batch_size, num_draft_tokens=4,
                             check_invariants=True, eos_token_id=[EOS])
    assert out.sequences == oracle(target, PROMPTS, 16, [EOS])
    assert not target.model.norm._forward_hooks


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # the lean forward, and the model's own
def test_the_conditioned_draft_adds_the_projected_feature_to_its_embedding(arch):
    target = tiny("llama", layers=2, seed=8)
    draft = conditioned_draft(target, seed=1, arch=arch)
    assert (draft.lean is not None) == (arch == "llama")
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    features = torch.randn(2, 7, target.config.hidden_size, dtype=torch.float64)
    pos, mask = torch.arange(7)[None].expand(2, -1), causal(7, 7)
    with torch.no_grad():
        got = draft(ids, pos, mask, DynamicCache(), features=features).logits
        embeds = draft.model.get_input_embeddings()(ids) + features @ draft.projection.weight.T
        want = draft.model(inputs_embeds=embeds, position_ids=pos, attention_mask=mask).logits
        blind = draft(ids, pos, mask, DynamicCache()).logits  # no feature: the token draft alone
        plain = draft.model(input_ids=ids, position_ids=pos, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(blind, plain, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, blind)


def test_the_loader_reads_both_feature_drafts_from_their_training_outputs(tmp_path):
    """`--draft feature:DIR` and `conditioned:DIR` load what the training scripts save, for the target
    they were trained for; a missing folder or another target's width is refused by name."""
    from specbatch.fast.loading import ModelLoadError, load_draft
    target = tiny("llama", layers=2, seed=9)
    for head in (False, True):  # the decoder-layer draft and the feature head (train_feature_head.py)
        draft, net = feature_draft(target, seed=5, head=head)
        net.save(tmp_path / f"feature{head}", range(0, VOCAB, 2), {"note": "test"})
        loaded, _ = load_draft(f"feature:{tmp_path / f'feature{head}'}", target, "float64")
        assert loaded.mlp == head
        ids, pos, mask = torch.tensor([[3, 9, 27, 4]]), torch.arange(4)[None], causal(4, 4)
        features = torch.randn(1, 4, target.config.hidden_size, dtype=torch.float64)
        with torch.no_grad():
            want = net.double()(target.get_input_embeddings()(ids), features, pos)
            got = loaded(ids, pos, mask, DynamicCache(), features=features).features
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)  # float16 on disk
    token_draft = tiny("llama", layers=1, seed=11)
    token_draft.save_pretrained(tmp_path / "conditioned")
    (tmp_path / "conditioned" / "output_tokens.json").write_text(json.dumps(list(range(VOCAB))))
    torch.save(torch.ones(32, target.config.hidden_size, dtype=torch.float16), tmp_path / "conditioned" /
               "feature_projection.pt")
    loaded, _ = load_draft(f"conditioned:{tmp_path / 'conditioned'}+lookup", target, "float64")
    assert isinstance(loaded, LookupFirstDraft) and loaded.reads_features
    with pytest.raises(ModelLoadError, match="not a folder"):
        load_draft(f"feature:{tmp_path / 'nowhere'}", target)
    with pytest.raises(ModelLoadError, match="another target"):
        load_draft(f"conditioned:{tmp_path / 'conditioned'}", tiny("llama", layers=2, seed=9, hidden_size=48,
                                                                    num_attention_heads=4))


@pytest.mark.parametrize("kind", sorted(DRAFTS))
def test_coupled_sampling_with_a_feature_draft_equals_target_only(kind):
    """Sampled with coupled randomness, a feature draft's run equals target-only decoding with the same
    seed token for token (its q only changes which proposals are accepted, never the output)."""
    target = tiny("llama", layers=2, seed=7)
    draft = LookupFirstDraft(DRAFTS[kind](target, 4))
    options = dict(max_new_tokens=14, batch_size=3, temperature=0.3, top_k=20, seed=11, sampling="coupled",
                   eos_token_id=[EOS])
    out = specbatch.generate(target, draft, PROMPTS, num_draft_tokens=3, policy="fixed", check_invariants=True,
                             **options)
    alone = specbatch.generate(target, None, PROMPTS, **options)
    assert out.sequences == alone.sequences
    stats = out.stats if isinstance(out.stats, dict) else out.stats.as_dict()
    assert stats["drafted_tokens"] > 0 and stats["accepted_tokens"] > 0  # proposals made, some accepted
