"""Nothing lost, nothing silent: results already on disk are never replaced unless asked, long
commands keep their finished work and resume to the file an uninterrupted run writes, an
interruption says what is on disk, every option is checked against what it means, and text is
what a reader expects (no special tokens, ids, input order)."""
import hashlib
import json
import sys

import pytest
import torch

import specbatch
from hf_models import EOS, PROMPTS, WORDS, tiny
from specbatch.cli.commands import main
from specbatch.options import OptionError


def gen_args(folders, prompts, *extra):
    return ["generate", "--target", folders["target"], "--draft", folders["draft"], "--prompts", str(prompts),
            "--dtype", "float64", "--max-new-tokens", "6", "--batch-size", "3", "--policy", "threshold", *extra]


def bench_args(folders, prompts, out_dir, *extra):
    return ["bench", "--target", folders["target"], "--draft", folders["draft"], "--prompts", str(prompts),
            "--dtype", "float64", "--max-new-tokens", "4", "--batch-sizes", "1,2", "--methods", "ar,ragged",
            "--repeats", "2", "--policy", "threshold", "--out-dir", str(out_dir), *extra]


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def exit_2_with(capsys, argv, message):
    """Exit 2 with exactly one error line on stderr naming the problem (progress bars aside)."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's verdict on a flag
        code = e.code
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x.strip() and "req/s" not in x and "s/req" not in x]
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert message in err[0], err[0]
    return err[0]


class InterruptAfter:
    """Wraps a function so that its call number `calls + 1` raises KeyboardInterrupt (a Ctrl-C)."""

    def __init__(self, fn, calls):
        self.fn, self.calls, self.seen = fn, calls, 0

    def __call__(self, *a, **kw):
        self.seen += 1
        if self.seen > self.calls:
            raise KeyboardInterrupt
        return self.fn(*a, **kw)


# ---------------------------------------------------------------- nothing replaced without being asked

def test_generate_refuses_an_out_that_holds_results_and_overwrites_only_when_asked(folders, prompt_file, tmp_path,
                                                                                    capsys):
    out = tmp_path / "o.jsonl"
    assert main(gen_args(folders, prompt_file, "--out", str(out), "--max-new-tokens", "8")) == 0
    before = digest(out), digest(f"{out}.settings.json")
    capsys.readouterr()
    line = exit_2_with(capsys, gen_args(folders, prompt_file, "--out", str(out)), "already holds results")
    assert "--resume" in line and "--overwrite" in line
    assert (digest(out), digest(f"{out}.settings.json")) == before  # an 8-token run is not lost to a 6-token one
    exit_2_with(capsys, gen_args(folders, prompt_file, "--out", str(out), "--resume", "--overwrite"),
                "give one of them")
    assert (digest(out), digest(f"{out}.settings.json")) == before
    assert main(gen_args(folders, prompt_file, "--out", str(out), "--overwrite")) == 0
    assert all(r["num_tokens"] <= 6 for r in map(json.loads, out.read_text().splitlines()))


@pytest.mark.parametrize("flag", ["--out", "--trace"])
def test_an_empty_output_path_is_refused_not_read_as_stdout(folders, prompt_file, capsys, flag):
    exit_2_with(capsys, gen_args(folders, prompt_file, flag, ""), "expected a file path, got an empty string")


def test_conform_sample_refuses_an_out_that_holds_outputs(folders, greedy_vectors, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": "x", "token_ids": [1]}\n')
    before = digest(out)
    exit_2_with(capsys, ["conform", "sample", str(greedy_vectors), "--target", folders["target"], "--out", str(out)],
                "already holds results")
    assert digest(out) == before


def test_bench_refuses_a_folder_that_holds_a_bench(folders, prompt_file, tmp_path, capsys):
    out_dir = tmp_path / "b"
    out_dir.mkdir()
    (out_dir / "bench.json").write_text("{}\n")
    exit_2_with(capsys, bench_args(folders, prompt_file, out_dir), "already holds a bench")
    assert (out_dir / "bench.json").read_text() == "{}\n" and not (out_dir / "runs.jsonl").exists()


# ---------------------------------------------------------------- long work kept, resumed, and told truly

@pytest.mark.full  # slow (a subprocess or many runs): the pre-merge profile
def test_bench_interrupted_then_resumed_equals_an_uninterrupted_run(folders, prompt_file, tmp_path, capsys,
                                                                    monkeypatch):
    import specbatch.cli.bench as bench
    whole = tmp_path / "whole"
    assert main(bench_args(folders, prompt_file, whole)) == 0
    capsys.readouterr()
    cut = tmp_path / "cut"
    monkeypatch.setattr(bench, "run_method", InterruptAfter(bench.run_method, 3))
    assert main(bench_args(folders, prompt_file, cut)) == 130
    assert "interrupted; 3 of 8 runs are in" in capsys.readouterr().err  # 2 repeats x 2 batch sizes x 2 methods
    assert len((cut / "runs.jsonl").read_text().splitlines()) == 3 and not (cut / "bench.json").exists()
    exit_2_with(capsys, bench_args(folders, prompt_file, cut), "already holds results")
    exit_2_with(capsys, bench_args(folders, prompt_file, cut, "--resume", "--max-new-tokens", "5"),
                "made with other settings")
    monkeypatch.setattr(bench, "run_method", InterruptAfter(bench.run_method.fn, 99))
    assert main(bench_args(folders, prompt_file, cut, "--resume")) == 0
    assert bench.run_method.seen == 5  # only the missing runs ran
    assert "resuming: 3 of 8 runs" in capsys.readouterr().err

    def outputs(folder):
        return [(r["id"], r["sequences"]) for r in map(json.loads, (folder / "runs.jsonl").read_text().splitlines())]
    assert outputs(cut) == outputs(whole)
    rows = lambda folder: [(r["method"], r["batch"], r["exact"]) for r in  # noqa: E731
                           json.loads((folder / "bench.json").read_text())["rows"]]
    assert rows(cut) == rows(whole)


@pytest.mark.full  # slow (a subprocess or many runs): the pre-merge profile
def test_conform_sample_interrupted_then_resumed_equals_an_uninterrupted_run(folders, prompt_file, tmp_path, capsys,
                                                                             monkeypatch):
    import specbatch.conformance.testing as testing
    vectors = tmp_path / "sampled"
    assert main(["conform", "make", "--sampled", "--target", folders["target"], "--samples", "8",
                 "--prompts", str(prompt_file), "--out", str(vectors)]) == 0
    run = ["conform", "sample", str(vectors), "--target", folders["target"], "--draft", folders["draft"],
           "--batch-size", "4"]
    whole = tmp_path / "whole.jsonl"
    assert main(run + ["--out", str(whole)]) == 0
    capsys.readouterr()
    made = testing.specbatch_sampling_engine
    calls = []

    def interrupted_engine(*a, **kw):
        calls.append(InterruptAfter(made(*a, **kw), 3))
        return calls[-1]
    monkeypatch.setattr(testing, "specbatch_sampling_engine", interrupted_engine)
    cut = tmp_path / "cut.jsonl"
    assert main(run + ["--out", str(cut)]) == 130
    err = capsys.readouterr().err
    assert "interrupted; 48 of 96 outputs are in" in err and "setting 3/6" in err  # 2 requests x 8 samples x 3
    assert len(cut.read_text().splitlines()) == 48
    calls.clear()
    monkeypatch.setattr(testing, "specbatch_sampling_engine", lambda *a, **kw: InterruptAfter(made(*a, **kw), 99))
    assert main(run + ["--out", str(cut), "--resume"]) == 0
    assert "resuming: 48 of 96 outputs" in capsys.readouterr().err
    assert cut.read_bytes() == whole.read_bytes()


def test_a_resumed_sampled_setting_that_was_cut_midway_runs_again_whole(folders, prompt_file, tmp_path, capsys):
    vectors = tmp_path / "sampled"
    assert main(["conform", "make", "--sampled", "--target", folders["target"], "--samples", "4",
                 "--prompts", str(prompt_file), "--out", str(vectors)]) == 0
    run = ["conform", "sample", str(vectors), "--target", folders["target"], "--batch-size", "4"]
    whole = tmp_path / "whole.jsonl"
    assert main(run + ["--out", str(whole)]) == 0
    cut = tmp_path / "cut.jsonl"
    lines = whole.read_text().splitlines(keepends=True)
    cut.write_text("".join(lines[:11]))  # the first setting (8 rows) and 3 rows of the second
    (tmp_path / "cut.jsonl.settings.json").write_text((tmp_path / "whole.jsonl.settings.json").read_text())
    capsys.readouterr()
    assert main(run + ["--out", str(cut), "--resume"]) == 0
    assert "resuming: 8 of 48 outputs" in capsys.readouterr().err
    assert cut.read_bytes() == whole.read_bytes()


def test_conform_sample_runs_greedy_vectors_through_any_strategy_and_they_conform(folders, greedy_vectors, tmp_path,
                                                                                   capsys):
    from hf_models import save_folder
    target = save_folder(tmp_path / "t", tiny("llama"))  # the model the vectors were made for (float64)
    for strategy in ("eqspec", "ragged"):
        out = tmp_path / f"{strategy}.jsonl"
        assert main(["conform", "sample", str(greedy_vectors), "--target", target, "--draft", "lookup",
                     "--strategy", strategy, "--batch-size", "5", "--out", str(out)]) == 0
        capsys.readouterr()
        assert main(["conform", "check", str(greedy_vectors), str(out), "--target", target]) == 0
        assert "CONFORMANT" in capsys.readouterr().out


def test_generate_interrupted_says_how_many_results_are_on_disk(folders, prompt_file, tmp_path, capsys, monkeypatch):
    import specbatch.cli.commands as cli
    real = cli.run_generate

    def two_then_ctrl_c(target, draft, ids, opts, on_result=None, **kw):
        kept = []
        real(target, draft, ids, opts, on_result=lambda *a: kept.append(a), **kw)
        for a in kept[:2]:
            on_result(*a)
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "run_generate", two_then_ctrl_c)
    out = tmp_path / "o.jsonl"
    assert main(gen_args(folders, prompt_file, "--out", str(out))) == 130
    assert f"interrupted; 2 of {len(PROMPTS)} results are in {out}" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 2


# ---------------------------------------------------------------- every option checked against what it means

@pytest.mark.parametrize("temperature", ["1e-308", "1e-310", "4e-324"])  # 1e-308: subnormal, finite reciprocal
def test_a_subnormal_temperature_is_refused(folders, prompt_file, capsys, temperature):
    exit_2_with(capsys, gen_args(folders, prompt_file, "--temperature", temperature),
                "temperature must be 0 (greedy) or a normal positive number")
    with pytest.raises(OptionError, match="normal positive number"):
        specbatch.generate(tiny("llama"), None, [[1, 2]], temperature=float(temperature))


def test_logits_are_shifted_to_a_top_of_zero_before_the_temperature_divides_them():
    """Large logits over the smallest normal temperature overflow to inf (and NaN after the softmax)
    unless the top logit is taken out first; shifted, all the mass sits on the argmax."""
    from specbatch.fast.sampling import processed_log_probs
    logits = torch.tensor([[100.0, 99.0, -50.0, 100.5], [3.0, 2.0, 1.0, 0.0]])
    for t in (sys.float_info.min, 1e-300, 1e-30):
        probs = processed_log_probs(logits, t, None, None).exp()
        assert torch.equal(probs, torch.tensor([[0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)), t
    ordinary = processed_log_probs(logits, 0.7, 2, None).exp()
    want = torch.softmax(torch.tensor([100.0, 100.5], dtype=torch.float64) / 0.7, dim=0)
    assert torch.allclose(ordinary[0, [0, 3]], want) and ordinary[0, 1:3].sum() == 0


@pytest.mark.parametrize("sampling", ["rejection", "coupled"])
def test_the_smallest_normal_temperature_samples_the_argmax(sampling):
    """logits / t overflows at a tiny normal t unless the top logit is taken out first: then every
    token but the argmax has probability 0, and sampling is greedy decoding."""
    target, draft = tiny("llama"), tiny("llama", layers=1, seed=9)
    prompts = [[3, 4, 5], [9], [20, 21, 22, 23]]
    greedy = specbatch.generate(target, None, prompts, max_new_tokens=8, eos_token_id=[]).sequences
    for t in (sys.float_info.min, 1e-300):
        got = specbatch.generate(target, draft, prompts, max_new_tokens=8, eos_token_id=[], temperature=t,
                                 sampling=sampling, seed=3).sequences
        assert got == greedy, t


@pytest.mark.parametrize("flags, message", [
    (["--fixed-k", "--draft-threshold", "0.5"], "--draft-threshold would be ignored"),
    (["--policy", "fixed", "--draft-floor", "0.1"], "--draft-floor would be ignored"),
    (["--fixed-k", "--policy", "goodput"], "--fixed-k is --policy fixed; it contradicts --policy goodput"),
])
def test_contradictory_proposal_flags_are_refused(folders, prompt_file, tmp_path, capsys, flags, message):
    argv = gen_args(folders, prompt_file, "--out", str(tmp_path / "o.jsonl"), *flags)
    argv.remove("--policy")
    argv.remove("threshold")
    exit_2_with(capsys, argv, message)
    assert not (tmp_path / "o.jsonl").exists()


def test_csv_prompts_are_read_by_their_header_and_a_csv_without_prompt_column_is_refused(folders, tmp_path, capsys):
    csv = tmp_path / "p.csv"
    csv.write_text('id,prompt\na,w10 w11\nb,"w20, w21\nw22"\n')
    from specbatch.io import read_prompts
    assert read_prompts(csv) == [("a", "w10 w11"), ("b", "w20, w21\nw22")]
    out = tmp_path / "o.jsonl"
    assert main(gen_args(folders, csv, "--out", str(out))) == 0
    assert [r["id"] for r in map(json.loads, out.read_text().splitlines())] == ["a", "b"]
    capsys.readouterr()
    bad = tmp_path / "q.csv"
    bad.write_text("question,answer\nw10,w11\n")
    exit_2_with(capsys, gen_args(folders, bad), "needs a header row with a 'prompt' column")
    tsv = tmp_path / "p.tsv"
    tsv.write_text("prompt\nw10\n")
    exit_2_with(capsys, gen_args(folders, tsv), ".tsv prompt files are not read")


def test_bench_per_category_without_categories_is_refused(folders, prompt_file, tmp_path, capsys):
    exit_2_with(capsys, bench_args(folders, prompt_file, tmp_path / "b", "--per-category", "1"),
                "no line of")
    assert not (tmp_path / "b").exists()


def test_check_trace_refuses_an_unknown_strategy_and_a_layout_the_strategy_does_not_have(folders, prompt_file,
                                                                                         tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert main(gen_args(folders, prompt_file, "--out", str(tmp_path / "o.jsonl"), "--trace", str(trace))) == 0
    capsys.readouterr()
    lines = trace.read_text().splitlines()
    for change, message in [(dict(strategy="nonsense"), "field 'strategy' must be one of"),
                            (dict(layout="rectangular"), "strategy 'ragged' lays rows out ragged")]:
        edited = tmp_path / "e.jsonl"
        edited.write_text("\n".join([json.dumps({**json.loads(lines[0]), **change})] + lines[1:]) + "\n")
        exit_2_with(capsys, ["check-trace", str(edited)], message)
    assert main(["check-trace", str(trace)]) == 0


def test_unknown_model_names_list_the_known_ones(capsys):
    from specbatch.errors import UserError
    from specbatch.prepare import load
    with pytest.raises(UserError, match=r"did you mean 'smollm2'\?\); known names: smollm2"):
        load("smolm2")
    with pytest.raises(UserError, match=r"did you mean 'lookup'\?.*known names: none, lookup"):
        _draft_name_error("lokup")


def _draft_name_error(name):
    from specbatch.errors import UserError
    from specbatch.fast.loading import ModelLoadError, load_draft
    try:
        load_draft(name, tiny("llama"), "float64", "cpu")
    except ModelLoadError as e:
        raise UserError(str(e)) from None


def test_bench_help_gives_every_flag_its_meaning_and_default(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("(default: 1,2,4,8)", "alternating the methods' order (default: 1)",
                  "wrap each prompt in the tokenizer's chat template", "(default: bench_out)"):
        assert words in text, words


# ---------------------------------------------------------------- text users can read

def test_stdout_answers_come_in_input_order_under_their_ids(folders, prompt_file, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    assert main(gen_args(folders, prompt_file, "--out", str(out))) == 0
    records = [json.loads(x) for x in out.read_text().splitlines()]
    capsys.readouterr()
    assert main(gen_args(folders, prompt_file, "--batch-size", "2")) == 0
    printed = capsys.readouterr().out
    assert printed == "".join(f"==> {r['id']} <==\n{r['text']}\n" for r in records)
    assert main(gen_args(folders, prompt_file, "--jsonl-stdout")) == 0
    assert [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()] == [r["id"] for r in records]


def test_string_prompts_take_the_chat_template_by_default_and_texts_leave_special_tokens_out(folders):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = AutoModelForCausalLM.from_pretrained(folders["target"], dtype=torch.float64)
    tok = AutoTokenizer.from_pretrained(folders["target"])
    templated = tok.apply_chat_template([{"role": "user", "content": "w10 w11"}], add_generation_prompt=True)
    templated = list(templated["input_ids"] if hasattr(templated, "keys") else templated)
    plain = tok("w10 w11")["input_ids"]
    assert templated != plain
    by_string = specbatch.generate(target, None, ["w10 w11"], tokenizer=tok, max_new_tokens=6)
    assert by_string.sequences == specbatch.generate(target, None, [templated], max_new_tokens=6).sequences
    as_is = specbatch.generate(target, None, ["w10 w11"], tokenizer=tok, max_new_tokens=6, chat_template=False)
    assert as_is.sequences == specbatch.generate(target, None, [plain], max_new_tokens=6).sequences
    from specbatch.api import decode_text
    assert decode_text([1, 10, 11, EOS, 0], tok) == "w10 w11"  # <s>, </s> and <unk> left out
    for result in (by_string, as_is):
        tokens = result.sequences[0]
        assert result.texts[0] == " ".join(WORDS[t] for t in tokens if t not in (0, 1, EOS))
    tok.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        specbatch.generate(target, None, ["w10"], tokenizer=tok, chat_template=True)


def test_progress_bars_are_labelled_by_method(capsys):
    target, draft = tiny("llama"), tiny("llama", layers=1, seed=9)
    specbatch.generate(target, None, [[1, 2]], max_new_tokens=2, progress=True)
    assert "target-only" in capsys.readouterr().err
    specbatch.generate(target, draft, [[1, 2]], max_new_tokens=2, progress=True, strategy="eqspec")
    assert "eqspec" in capsys.readouterr().err
    specbatch.generate(target, None, [[1, 2]], max_new_tokens=2, progress="reference (target-only)")
    assert "reference (target-only)" in capsys.readouterr().err
