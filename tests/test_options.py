"""One options object: the API, the CLI (flags and help), bench, demo and the reference all take
their defaults from specbatch.options.defaults(), so a default changed there changes all of them."""
import dataclasses
import json

import pytest

import specbatch
from hf_models import PROMPTS as TEXT_PROMPTS
from hf_models import tiny
from specbatch import options
from specbatch.cli.commands import build_parser, main, options_from_args
from specbatch.fast.drafts.scripted import ScriptedDraft
from specbatch.reference import ScriptedDraft as ReferenceScriptedDraft
from specbatch.reference import ToyLM, deviate_hashed
from specbatch.reference import generate as reference_generate

PROMPTS = [[3, 4, 5], [6], [7, 8, 9, 10, 11]]


def header(path):
    return json.loads(open(path).readline())


def rows_per_round(path):
    return max(len(x["rows"]) for x in map(json.loads, open(path)) if "round" in x)


@pytest.fixture()
def changed(monkeypatch):
    """Defaults no code path uses by accident: k 3, batch 2, threshold 0.5, 6 new tokens."""
    new = dataclasses.replace(options.DEFAULTS, num_draft_tokens=3, batch_size=2, draft_threshold=0.5,
                              max_new_tokens=6)
    assert new != options.DEFAULTS
    monkeypatch.setattr(options, "DEFAULTS", new)
    return new


def test_api_follows_the_defaults(changed, tmp_path):
    target = tiny("llama")
    result = specbatch.generate(target, ScriptedDraft(target, deviate_hashed(1, 0.3)), PROMPTS,
                                trace=tmp_path / "t.jsonl")
    h = header(tmp_path / "t.jsonl")
    assert (h["num_draft_tokens"], h["draft_threshold"], h["max_new_tokens"]) == (3, 0.5, [6, 6, 6])
    assert rows_per_round(tmp_path / "t.jsonl") <= 2
    assert all(len(s) <= 6 for s in result.sequences)


def test_cli_flags_and_help_follow_the_defaults(changed, folders, prompt_file, tmp_path):
    parser = build_parser()
    args = parser.parse_args(["generate", "--target", "t", "--prompts", "p"])
    opts, given = options_from_args(args)
    assert opts == dataclasses.replace(changed, draft_floor=0.2) and given == {}
    help_text = " ".join(parser._subparsers._group_actions[0].choices["generate"].format_help().split())
    assert "(default: 3)" in help_text and "(default: 0.5)" in help_text
    trace = tmp_path / "t.jsonl"
    assert main(["generate", "--target", folders["target"], "--draft", folders["draft"], "--prompts",
                 str(prompt_file), "--dtype", "float64", "--out", str(tmp_path / "o.jsonl"),
                 "--trace", str(trace)]) == 0
    h = header(trace)
    assert (h["num_draft_tokens"], h["draft_threshold"], h["max_new_tokens"][0]) == (3, 0.5, 6)
    assert rows_per_round(trace) <= 2


def test_bench_and_demo_follow_the_defaults(changed, folders, prompt_file, tmp_path, monkeypatch):
    seen = []
    real = specbatch.api.generate

    def spy(target, draft, prompts, options=None, **kw):
        seen.append(options)
        return real(target, draft, prompts, options, **kw)
    monkeypatch.setattr(specbatch.api, "generate", spy)
    assert main(["bench", "--target", folders["target"], "--draft", folders["draft"], "--prompts", str(prompt_file),
                 "--dtype", "float64", "--batch-sizes", "1", "--methods", "ar,ragged",
                 "--out-dir", str(tmp_path / "b")]) == 0
    assert seen and all(o.num_draft_tokens == 3 and o.draft_threshold == 0.5 for o in seen)
    assert {o.max_new_tokens for o in seen} == {options.COMMAND_DEFAULTS["bench"]["max_new_tokens"]}
    saved = json.loads((tmp_path / "b" / "bench.json").read_text())["setup"]["options"]
    assert saved["num_draft_tokens"] == 3 and saved["draft_threshold"] == 0.5
    demo, _ = options_from_args(build_parser().parse_args(["demo"]), "demo")
    assert demo.num_draft_tokens == 3 and demo.draft_threshold == 0.5
    assert demo.batch_size == options.COMMAND_DEFAULTS["demo"]["batch_size"]


def test_reference_follows_the_defaults(changed, tmp_path):
    target = ToyLM()
    draft = ReferenceScriptedDraft(target, deviate_hashed(1, 0.3))
    result = reference_generate(target, draft, PROMPTS, trace=tmp_path / "t.jsonl")
    h = header(tmp_path / "t.jsonl")
    assert (h["num_draft_tokens"], h["strategy"], h["max_new_tokens"]) == (3, changed.strategy, [6, 6, 6])
    assert rows_per_round(tmp_path / "t.jsonl") <= 2 and all(len(s) == 6 for s in result.sequences)


def test_keywords_win_over_an_options_object_and_unknown_names_are_refused():
    target = tiny("llama")
    base = specbatch.GenerateOptions(max_new_tokens=5, batch_size=1)
    assert specbatch.generate(target, None, PROMPTS, base).sequences == \
        specbatch.generate(target, None, PROMPTS, max_new_tokens=5, batch_size=3).sequences
    assert all(len(s) == 2 for s in specbatch.generate(target, None, PROMPTS, base, max_new_tokens=2).sequences)
    with pytest.raises(TypeError, match="did you mean 'num_draft_tokens'"):
        specbatch.generate(target, None, PROMPTS, num_draft_token=3)
    with pytest.raises(TypeError, match="GenerateOptions"):
        specbatch.generate(target, None, PROMPTS, {"max_new_tokens": 3})


def test_a_default_floor_follows_a_lower_threshold_and_a_chosen_one_is_checked():
    target = tiny("llama")
    draft = ScriptedDraft(target, deviate_hashed(1, 0.3))
    specbatch.generate(target, draft, PROMPTS, max_new_tokens=4, draft_threshold=0.1)  # floor 0.2 lowered to 0.1
    with pytest.raises(options.OptionError, match="draft_floor must be <= draft_threshold"):
        specbatch.generate(target, draft, PROMPTS, max_new_tokens=4, draft_threshold=0.1, draft_floor=0.15)
    with pytest.raises(options.OptionError, match="draft_floor must be <= draft_threshold"):
        specbatch.generate(target, draft, PROMPTS, specbatch.GenerateOptions(draft_threshold=0.1, draft_floor=0.15))
    cli, _ = options_from_args(build_parser().parse_args(["generate", "--target", "t", "--prompts", "p",
                                                          "--draft-threshold", "0.1"]))
    assert cli.draft_floor == 0.1


def test_every_field_has_help_and_a_default_that_passes_its_own_checks():
    for name in options.GenerateOptions.names():
        assert options.GenerateOptions.help(name).endswith(f"(default: {getattr(options.DEFAULTS, name)})")
    assert options.check_options(options.DEFAULTS, len(TEXT_PROMPTS), floor_chosen=False) == options.DEFAULTS


def test_the_api_page_lists_every_field_with_its_default():
    from pathlib import Path
    page = (Path(__file__).parents[1] / "docs" / "api.md").read_text()
    for name in options.GenerateOptions.names():
        assert f"| `{name}` | `{getattr(options.GenerateOptions(), name)}` |" in page, name
