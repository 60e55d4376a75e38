"""The extension seams are real: a strategy registered from this file alone (one class for the torch
engine, its twin function for the reference) runs through specbatch.generate, the reference and the
CLI's choices, and is exact against target-only decoding on both; a draft kind registered from this
file alone loads by name (API and CLI) and is exact under every strategy."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import specbatch
from hf_models import EOS, VOCAB, oracle, tiny
from reference_cases import TARGET, oracle as reference_oracle
from specbatch import reference
from specbatch.cli.commands import build_parser, main
from specbatch.fast import loading
from specbatch.fast import strategies as fast_strategies
from specbatch.fast.drafts.scripted import ScriptedDraft
from specbatch.fast.loading import DraftKind, load_draft
from specbatch.fast.models import WeightlessLM, vocab_size
from specbatch.fast.strategies.eqspec import Eqspec
from specbatch.reference import ScriptedDraft as ReferenceScriptedDraft, deviate_hashed
from specbatch.reference import strategies as reference_strategies

RNG = np.random.default_rng(3)
PROMPTS = [RNG.integers(0, VOCAB, n).tolist() for n in (30, 2, 11, 1, 7)]


class ShortestFirst(Eqspec):
    """Toy strategy: EQSPEC's fixed batches, filled shortest prompt first (greedy, no arrival times).
    Results still come back under each request's own id."""

    def run(self, target, draft, prompts, max_new, settings, stats, clock, batch_size, on_done):
        order = sorted(range(len(prompts)), key=lambda r: (len(prompts[r]), r))
        super().run(target, draft, [prompts[r] for r in order], [max_new[r] for r in order], settings, stats, clock,
                    batch_size, lambda request, *rest: on_done(order[request], *rest))


@reference_strategies.layout("rectangular")
def shortest_first(job):
    """The toy's reference twin: the reference's EQSPEC with the submission order sorted."""
    job.order = sorted(job.order, key=lambda r: (len(job.prompts[r]), r))
    reference_strategies.eqspec(job)


@pytest.fixture()
def toy(monkeypatch):
    monkeypatch.setitem(fast_strategies.STRATEGIES, "shortest-first", ShortestFirst)
    monkeypatch.setitem(reference_strategies.STRATEGIES, "shortest-first", shortest_first)
    return "shortest-first"


def test_the_engine_and_the_reference_have_the_same_strategies():
    assert set(specbatch.STRATEGIES) == set(reference.STRATEGIES) == {"eqspec", "exspec", "ragged"}
    for name, cls in specbatch.STRATEGIES.items():
        assert cls.layout == reference.STRATEGIES[name].layout


def test_a_registered_strategy_is_exact_in_the_engine(toy):
    target = tiny("llama")
    draft = ScriptedDraft(target, deviate_hashed(5, 0.3))
    budgets = [9, 4, 12, 6, 3]
    result = specbatch.generate(target, draft, PROMPTS, max_new_tokens=budgets, num_draft_tokens=3, batch_size=2,
                                strategy=toy, check_invariants=True, policy="fixed")
    assert result.sequences == oracle(target, PROMPTS, budgets, [EOS])
    assert result.stats["rounds"] > 0 and result.stats["acceptance_rate"] < 1.0


def test_a_registered_strategy_is_exact_in_the_reference(toy):
    draft = ReferenceScriptedDraft(TARGET, deviate_hashed(5, 0.3))
    prompts = [[t % 24 for t in p] for p in PROMPTS]
    result = reference.generate(TARGET, draft, prompts, max_new_tokens=7, num_draft_tokens=3, batch_size=2,
                                eos_token_id=[5], strategy=toy, check_invariants=True)
    assert result.sequences == reference_oracle(prompts, 7, [5])
    eqspec = reference.generate(TARGET, draft, prompts, max_new_tokens=7, num_draft_tokens=3, batch_size=2,
                                eos_token_id=[5], strategy="eqspec")
    assert result.stats["rounds"] != eqspec.stats["rounds"] or result.stats["fallback_rounds"] != \
        eqspec.stats["fallback_rounds"], "the toy should batch differently from eqspec"


def test_a_registered_strategy_is_a_cli_choice_and_unknown_names_are_refused(toy):
    args = build_parser().parse_args(["generate", "--strategy", toy, "--target", "t", "--prompts", "p", "--out", "o"])
    assert args.strategy == toy
    with pytest.raises(ValueError, match="unknown strategy 'nope'.*'shortest-first'"):
        specbatch.generate(tiny("llama"), None, PROMPTS, strategy="nope")
    with pytest.raises(ValueError, match="unknown strategy 'nope'.*'shortest-first'"):
        reference.generate(TARGET, None, [[1, 2]], strategy="nope")


def test_registering_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        fast_strategies.register("ragged", ShortestFirst)
    with pytest.raises(ValueError, match="already registered"):
        reference_strategies.register("ragged", shortest_first)


class EchoDraft(WeightlessLM):
    """Toy draft kind: proposes the token it was just fed (accepted wherever the target repeats a token),
    with a dummy cache entry per token so that the engine's cache bookkeeping runs as for a model."""

    def __init__(self, vocab: int, generation_config=None):
        super().__init__(vocab, "echo", generation_config)
        self.register_buffer("scores", 4.0 * torch.eye(vocab, dtype=torch.float64))

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, cache=None, logits_to_keep=0, **kw):
        dummy = torch.zeros(input_ids.shape[0], 1, input_ids.shape[1], 1, dtype=torch.float64,
                            device=input_ids.device)
        cache.update(dummy, dummy, 0)
        logits = self.scores[input_ids]
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


@pytest.fixture()
def echo(monkeypatch):
    monkeypatch.setitem(loading.DRAFT_KINDS, "echo", DraftKind(
        lambda argument, target, dtype, device: EchoDraft(vocab_size(target), target.generation_config).to(device)))
    return "echo"


@pytest.mark.parametrize("strategy", ["eqspec", "exspec", "ragged"])
@pytest.mark.parametrize("spec", ["echo", "echo+lookup"])
def test_a_registered_draft_kind_loads_by_name_and_is_exact(echo, strategy, spec):
    target = tiny("llama")
    draft, _ = load_draft(spec, target)
    budgets = [12, 4, 9, 16, 6]
    result = specbatch.generate(target, draft, PROMPTS, max_new_tokens=budgets, num_draft_tokens=3, batch_size=3,
                                strategy=strategy, check_invariants=True, policy="fixed")
    assert result.sequences == oracle(target, PROMPTS, budgets, [EOS])
    assert result.stats["drafted_tokens"] > 0


def test_a_registered_draft_kind_is_a_cli_draft_and_is_named_among_the_known(echo, folders, prompt_file, tmp_path,
                                                                            capsys):
    out = tmp_path / "out.jsonl"
    common = ["--target", str(folders["target"]), "--prompts", str(prompt_file), "--max-new-tokens", "6",
              "--dtype", "float64"]
    assert main(["generate", *common, "--draft", echo, "--out", str(out)]) == 0
    assert main(["generate", *common, "--draft", "none", "--out", str(tmp_path / "alone.jsonl")]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    alone = [json.loads(x) for x in (tmp_path / "alone.jsonl").read_text().splitlines()]
    assert [x["token_ids"] for x in lines] == [x["token_ids"] for x in alone]
    assert main(["generate", *common, "--draft", "ech", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "did you mean 'echo'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="already registered"):
        loading.register_draft("lookup", DraftKind(lambda *a: None))


def test_every_processor_setting_is_an_option_a_flag_and_a_kit_key():
    """A processor setting is named once, by its field in reference.processors.Processors; the API's
    options, the CLI's flags and the kits' keys follow from that name."""
    from specbatch.conformance.processor_vectors import SETTING_KEYS
    from specbatch.conformance.sampled import PROCESSOR_KEYS
    from specbatch.reference.processors import PROCESSOR_SETTINGS
    generate_help = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    for name in PROCESSOR_SETTINGS:
        assert name in specbatch.GenerateOptions.names()
        assert "--" + name.replace("_", "-") in generate_help
        assert name in SETTING_KEYS or name == "min_p"  # min_p never changes a greedy choice
        assert name in PROCESSOR_KEYS or name == "stop"  # stop strings: the greedy processor vectors
