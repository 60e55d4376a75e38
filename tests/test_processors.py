"""Logit processors and stop strings: the NumPy reference's definitions against closed forms, the
torch processors against the reference at every verify query, and every strategy with speculation
on against target-only decoding with the same processors (reference.processors.processed_greedy_decode)."""
import dataclasses
import json

import numpy as np
import pytest
import torch

import specbatch
from hf_models import EOS, FIXED_K, VOCAB, save_folder, tiny, word_tokenizer
from profiles import only_full
from specbatch.cli.commands import main
from specbatch.fast.drafts.scripted import ScriptedDraft
from specbatch.fast.processors import LogitProcessors
from specbatch.fast.sampling import processed_log_probs
from specbatch.options import OptionError
from specbatch.reference import deviate_hashed
from specbatch.reference.processors import (Processors, process_logits, processed_greedy_decode,
                                            sampling_distribution, stop_cut, stop_text)

STRATEGIES = ["eqspec", "exspec", "ragged"]
PROMPTS = [[5, 9, 11, 12, 5, 9], [20], [30, 31, 32, 33, 34], [50, EOS, 52], [60, 61]]
SETTINGS = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={40: 0.5, 41: -2.0},
                min_tokens=3)


def logits_fn(model):
    def logits_of(ids):
        with torch.no_grad():
            return model(torch.tensor([ids], device=model.device)).logits[0].double().cpu().numpy()
    return logits_of


def decode(tokens):
    return word_tokenizer().decode(tokens, skip_special_tokens=True)


def oracle(model, prompts, budget, proc, eos=(EOS,), stops=False):
    procs = proc if isinstance(proc, list) else [proc] * len(prompts)
    return [processed_greedy_decode(logits_fn(model), p, budget, q, eos, decode if stops else None)
            for p, q in zip(prompts, procs)]


# ---------------------------------------------------------------- the reference's definitions

def test_reference_processors_against_closed_forms():
    logits = np.array([2.0, -1.0, 0.5, -0.5, 1.0, 0.0])
    # repetition: prompt and new tokens alike, positive logits divided, negative multiplied
    got = process_logits(logits, prompt=[0], generated=[1, 1], proc=Processors(repetition_penalty=2.0))
    np.testing.assert_array_equal(got, [1.0, -2.0, 0.5, -0.5, 1.0, 0.0])
    # presence and frequency: new tokens only, count-weighted
    got = process_logits(logits, prompt=[2], generated=[3, 3, 4], proc=Processors(presence_penalty=0.5,
                                                                                  frequency_penalty=0.25))
    np.testing.assert_array_equal(got, [2.0, -1.0, 0.5, -0.5 - 0.5 - 0.5, 1.0 - 0.25 - 0.5, 0.0])
    # bias first, then the penalty sees the biased logit's sign
    got = process_logits(logits, prompt=[1], generated=[], proc=Processors(logit_bias={1: 3.0}, repetition_penalty=2.0))
    assert got[1] == 1.0
    # min_tokens: every EOS id held back while fewer than min_tokens new tokens exist
    proc = Processors(min_tokens=2)
    assert np.isneginf(process_logits(logits, [], [7], proc, eos_ids=[0, 4])[[0, 4]]).all()
    np.testing.assert_array_equal(process_logits(logits, [], [7, 7], proc, eos_ids=[0, 4]), logits)


def test_reference_min_p_and_stop_strings():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    np.testing.assert_allclose(sampling_distribution(logits, 1.0, min_p=0.4), [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    np.testing.assert_allclose(sampling_distribution(logits, 1.0, min_p=0.0), [0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(sampling_distribution(logits, 1.0, top_k=3, min_p=0.5), [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    text = lambda tokens: "".join("ab c"[t] for t in tokens)  # noqa: E731
    assert stop_cut([0, 1, 2, 3, 0], text, ("b c",)) == 4  # "ab c": completed by the 4th token
    assert stop_cut([0, 1, 2, 3, 0], text, ("ca",), before=3) == 5  # the first 3 tokens were judged already
    assert stop_cut([0, 1], text, ("zz",)) is None
    assert stop_text("ab cab", ("b c", "ca")) == "a"


def test_torch_processors_equal_the_reference_at_every_verify_query():
    """Query j of a row sees the committed tokens and the row's drafts d_0 .. d_{j-1}; the draft's
    step s sees the drafts so far. Rows of one batch carry different settings."""
    rng = np.random.default_rng(0)
    vocab, width, eos = 24, 4, [3, 5]
    prompts = [rng.integers(0, vocab, n).tolist() for n in (5, 1, 8)]
    settings = [Processors(repetition_penalty=1.7, frequency_penalty=0.4, min_tokens=4),
                Processors(presence_penalty=-0.6, logit_bias={3: 2.0, 7: -1.0}),
                Processors(repetition_penalty=0.8, presence_penalty=0.3, frequency_penalty=-0.2, min_tokens=2)]
    proc = LogitProcessors(settings, prompts, [10, 10, 10], eos, torch.device("cpu"))
    committed = [rng.integers(0, vocab, n).tolist() for n in (2, 0, 3)]
    for r, tokens in enumerate(committed):  # commit them as a round would, row by row
        choice = torch.tensor([tokens + [0] * (width - len(tokens))])
        proc.finish_round(torch.tensor([r]), choice, np.array([len(tokens)]), np.array([0]))
    requests = torch.tensor([2, 0, 1])
    drafted = torch.as_tensor(rng.integers(0, vocab, (3, width - 1)))
    logits = torch.as_tensor(rng.normal(size=(3, width, vocab)))
    got = proc.process(logits, requests, drafted).numpy()
    for i, r in enumerate(requests.tolist()):
        for j in range(width):
            want = process_logits(logits[i, j].numpy(), prompts[r], committed[r] + drafted[i, :j].tolist(),
                                  settings[r], eos)
            np.testing.assert_array_equal(got[i, j], want)
        step = 2  # the draft's third step
        got_draft = proc.process(logits[i:i + 1, 0], requests[i:i + 1], drafted[i:i + 1, :step]).numpy()[0]
        want = process_logits(logits[i, 0].numpy(), prompts[r], committed[r] + drafted[i, :step].tolist(),
                              settings[r], eos)
        np.testing.assert_array_equal(got_draft, want)


def test_torch_min_p_equals_the_reference():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 30)) * 2
    min_p = torch.tensor([0.0, 0.1, 0.5])[:, None]
    got = processed_log_probs(torch.as_tensor(logits), 0.8, 12, 0.9, min_p).exp().numpy()
    for i, m in enumerate([0.0, 0.1, 0.5]):
        np.testing.assert_allclose(got[i], sampling_distribution(logits[i], 0.8, 12, 0.9, m), atol=1e-12)


# ---------------------------------------------------------------- the engine against the oracle

def test_the_cases_exercise_what_they_claim():
    """A penalty changes the argmax inside what one round accepts; min_tokens holds back an EOS."""
    target = tiny("llama")
    plain = oracle(target, PROMPTS, 12, Processors())
    processed = oracle(target, PROMPTS, 12, Processors(**SETTINGS))
    assert any(a[1:4] != b[1:4] and a[:1] == b[:1] for a, b in zip(plain, processed)) or \
        any(a[:4] != b[:4] for a, b in zip(plain, processed))
    eos_early = oracle(target, PROMPTS, 12, Processors(logit_bias={EOS: 4.0}))
    held = oracle(target, PROMPTS, 12, Processors(logit_bias={EOS: 4.0}, min_tokens=3))
    assert any(len(a) < 3 and a[-1] == EOS for a in eos_early)
    assert all(len(b) >= 3 for b in held) and any(b[-1] == EOS for b in held)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("draft", only_full("scripted", "self", "none"))
def test_greedy_with_processors_equals_target_only_decoding_with_them(strategy, draft):
    target = tiny("llama")
    chosen = {"none": None, "self": target, "scripted": ScriptedDraft(target, deviate_hashed(7, 0.35))}[draft]
    for settings in (SETTINGS, dict(logit_bias={EOS: 4.0}, min_tokens=3, repetition_penalty=1.3)):
        want = oracle(target, PROMPTS, 12, Processors(**settings))
        result = specbatch.generate(target, chosen, PROMPTS, max_new_tokens=12, num_draft_tokens=3, batch_size=3,
                                    eos_token_id=[EOS], strategy=strategy, check_invariants=True, **settings,
                                    **FIXED_K)
        assert result.sequences == want
        if draft == "self":  # the draft applies the same processors over its own proposals: all accepted
            assert result.stats["acceptance_rate"] == 1.0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_prompt_settings_reach_their_own_rows(strategy):
    """Mixed settings in one batch, and a budget of 1 (no drafts possible) beside rows that draft."""
    target = tiny("llama")
    penalties = [1.0, 1.8, 1.2, 2.5, 0.7]
    budgets = [12, 1, 9, 12, 6]
    procs = [Processors(repetition_penalty=r, frequency_penalty=f) for r, f in zip(penalties, [0, .5, 0, 1., 0])]
    want = [oracle(target, [p], b, q)[0] for p, b, q in zip(PROMPTS, budgets, procs)]
    result = specbatch.generate(target, target, PROMPTS, max_new_tokens=budgets, num_draft_tokens=4, batch_size=5,
                                eos_token_id=[EOS], strategy=strategy, repetition_penalty=penalties,
                                frequency_penalty=[0, .5, 0, 1., 0], **FIXED_K)
    assert result.sequences == want


@pytest.mark.parametrize("strategy", only_full("ragged", "eqspec", "exspec"))
def test_stop_strings_inside_an_accepted_block(strategy):
    """The self draft proposes 4 tokens and all are accepted (5 committed a round); stop strings
    complete in the middle of such a block, and across two rounds. Nothing past the completing
    token is returned; the text ends before the stop string."""
    target = tiny("llama")
    plain = oracle(target, PROMPTS, 12, Processors())
    words = [decode(s).split() for s in plain]
    # two words completing at token 5 (the end of round 1), one word at token 3 (inside round 1), two
    # words at tokens 5-6 (across rounds 1 and 2)
    stops = (" ".join(words[0][3:5]), words[1][2], " ".join(words[3][4:6]))
    want = oracle(target, PROMPTS, 12, Processors(stop=stops), stops=True)
    assert [len(w) for w in want[:4]] == [5, 3, 2, 6]
    result = specbatch.generate(target, target, PROMPTS, max_new_tokens=12, num_draft_tokens=4, batch_size=3,
                                eos_token_id=[EOS], strategy=strategy, stop=list(stops), tokenizer=word_tokenizer(),
                                check_invariants=True, **FIXED_K)
    assert result.sequences == want
    for tokens, reason, text in zip(result.sequences, result.stop_reasons, result.texts):
        full = decode(tokens)
        if reason == "stop":
            assert stop_cut(tokens, decode, stops) == len(tokens) and text == full[:min(
                full.find(s) for s in stops if s in full)]
        else:
            assert text == full and stop_cut(tokens, decode, stops) is None


@pytest.mark.parametrize("strategy,sampling", [("ragged", "coupled"), ("eqspec", "rejection"),
                                               *[pytest.param(*c, marks=pytest.mark.full) for c in [
                                                   ("ragged", "rejection"), ("eqspec", "coupled"),
                                                   ("exspec", "coupled"), ("exspec", "rejection")]]])
def test_sampling_with_processors_keeps_each_mode_exact(strategy, sampling):
    """coupled: the same tokens with and without speculation; rejection: every verify query's target
    distribution is the reference's processed distribution (the sampler is exact for any p)."""
    target = tiny("llama")
    kw = dict(max_new_tokens=10, num_draft_tokens=3, batch_size=3, eos_token_id=[EOS], strategy=strategy,
              temperature=0.9, top_k=30, sampling=sampling, seed=3, repetition_penalty=1.4, frequency_penalty=0.4,
              min_p=0.1, min_tokens=2)
    alone = specbatch.generate(target, None, PROMPTS, **kw).sequences
    speculative = specbatch.generate(target, ScriptedDraft(target, deviate_hashed(7, 0.35)), PROMPTS, **kw,
                                     **FIXED_K).sequences
    if sampling == "coupled":
        assert speculative == alone
    # each sampled token has positive probability under the reference's processed distribution
    proc = Processors(repetition_penalty=1.4, frequency_penalty=0.4, min_p=0.1, min_tokens=2)
    logits_of = logits_fn(target)
    for prompt, tokens in zip(PROMPTS, speculative):
        for j, token in enumerate(tokens):
            x = process_logits(logits_of(prompt + tokens[:j])[-1], prompt, tokens[:j], proc, [EOS])
            assert sampling_distribution(x, 0.9, 30, None, 0.1)[token] > 0


def test_rejection_verify_uses_the_processed_distribution_of_each_query():
    from specbatch.fast.sampling import make_chooser
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, VOCAB, 4).tolist() for _ in range(2)]
    settings = [Processors(repetition_penalty=1.6, min_p=0.05), Processors(frequency_penalty=0.7, min_p=0.2)]
    proc = LogitProcessors(settings, prompts, [8, 8], [EOS], torch.device("cpu"))
    chooser = make_chooser(0.8, None, None, 0, "rejection", 2, torch.device("cpu"), processors=proc)
    logits = torch.as_tensor(rng.normal(size=(2, 3, VOCAB)))
    drafted = torch.as_tensor(rng.integers(0, VOCAB, (2, 2)))
    got = chooser.log_probs(logits, torch.tensor([0, 1]), drafted).exp().numpy()
    for r in range(2):
        for j in range(3):
            x = process_logits(logits[r, j].numpy(), prompts[r], drafted[r, :j].tolist(), settings[r], [EOS])
            np.testing.assert_allclose(got[r, j], sampling_distribution(x, 0.8, min_p=settings[r].min_p), atol=1e-12)


# ---------------------------------------------------------------- arguments and the CLI

@pytest.mark.parametrize("settings,message", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be"),
    (dict(presence_penalty=2.5), "presence_penalty must be"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be"),
    (dict(min_p=1.5), "min_p must be"),
    (dict(min_tokens=13), "min_tokens (13) must be at most max_new_tokens (12)"),
    (dict(min_tokens=-1), "min_tokens must be"),
    (dict(logit_bias={3: 101.0}), "logit_bias[3] must be"),
    (dict(logit_bias={VOCAB: 1.0}), "logit_bias key must be an integer token id"),
    (dict(logit_bias=[1, 2, 3, 4, 5]), "logit_bias must be a dict"),
    (dict(logit_bias=[{}, {}]), "logit_bias has 2 entries for 5 prompts"),
    (dict(stop=["ok", ""]), "stop must be a list of non-empty strings"),
    (dict(stop=["w3"]), "pass tokenizer= with stop="),
    (dict(repetition_penalty=[1.0, 1.2]), "repetition_penalty has 2 entries for 5 prompts"),
])
def test_bad_processor_settings_name_the_argument(settings, message):
    with pytest.raises(ValueError) as error:
        specbatch.generate(tiny("llama"), None, PROMPTS, max_new_tokens=12, **settings)
    assert message in str(error.value)
    if "tokenizer" not in message and "logit_bias key" not in message:
        assert isinstance(error.value, OptionError)


def test_cli_generate_with_processors_and_stop_equals_target_only_decoding(tmp_path):
    """specbatch generate --repetition-penalty 1.3 --min-p 0.05 --stop ... with speculation on."""
    target = tiny("llama")
    folder = save_folder(tmp_path / "model", target)
    prompts = ["w5 w9 w11 w12 w5 w9", "w20", "w30 w31 w32 w33 w34"]
    ids = [[int(w[1:]) for w in p.split()] for p in prompts]
    unstopped = Processors(repetition_penalty=1.3, logit_bias={40: 0.25, 41: -1.0})
    stop = " ".join(decode(oracle(target, ids[:1], 12, unstopped)[0]).split()[2:4])
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--target", folder, "--draft", folder, "--prompts", str(tmp_path / "p.txt"), "--dtype",
            "float64", "--max-new-tokens", "12", "--policy", "fixed", "--repetition-penalty", "1.3", "--min-p", "0.05",
            "--stop", stop, "--logit-bias", "40:0.25,41:-1", "--out", str(out)]
    assert main(argv) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    want = oracle(target, ids, 12, dataclasses.replace(unstopped, stop=(stop,)), stops=True)
    assert [x["token_ids"] for x in lines] == want
    assert lines[0]["stop_reason"] == "stop" and stop not in lines[0]["text"]
    # a resumed run keeps the stopped result and accepts the record written with the same settings
    kept = out.read_text().splitlines()
    out.write_text(kept[0] + "\n")
    assert main([*argv[:-2], "--out", str(out), "--resume"]) == 0
    assert [json.loads(x)["token_ids"] for x in out.read_text().splitlines()] == want


@pytest.mark.parametrize("flag,value,message", [
    ("--logit-bias", "40", "expected ID:BIAS pairs"),
    ("--logit-bias", "40:500", "logit_bias[40] must be"),
    ("--presence-penalty", "3", "presence_penalty must be"),
    ("--min-p", "2", "expected a probability"),
    ("--repetition-penalty", "0", "expected a finite positive number"),
])
def test_cli_bad_processor_flags_are_one_line(folders, prompt_file, capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--target", folders["target"], "--prompts", str(prompt_file), flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_stop_strings_per_prompt():
    """stop: one list for every prompt, or one entry per prompt (a string, a list or None)."""
    from specbatch.options import OptionError, stops_per_prompt
    assert stops_per_prompt(["a b", "c"], 2) == [("a b", "c")] * 2
    assert stops_per_prompt("a", 3) == [("a",)] * 3
    assert stops_per_prompt([["a"], None, "b"], 3) == [("a",), (), ("b",)]
    with pytest.raises(OptionError, match="stop has 2 entries for 3 prompts"):
        stops_per_prompt([["a"], ["b"]], 3)
    with pytest.raises(OptionError, match="stop must be a list of non-empty strings"):
        stops_per_prompt([["a"], [""]], 2)
