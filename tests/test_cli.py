"""The command line, in-process and as a subprocess, on tiny model folders saved with a real
`tokenizers` tokenizer: results, order, resume, verify, bench, check-trace, and bad input."""
import json
import subprocess
import sys

import pytest
import torch

import specbatch
import specbatch.io
from hf_models import EOS, PROMPTS, VOCAB, WORDS, hf_greedy
from specbatch.cli.commands import main

def args(folders, prompt_file, *extra):
    return ["--target", folders["target"], "--draft", folders["draft"], "--prompts", str(prompt_file),
            "--dtype", "float64", "--max-new-tokens", "10", "--batch-size", "3", *extra]


def expected(folders):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(folders["target"], dtype=torch.float64)
    tok = AutoTokenizer.from_pretrained(folders["target"])
    return [hf_greedy(model, tok(p)["input_ids"], 10, (EOS,)) for p in PROMPTS]


@pytest.mark.parametrize("strategy", ["eqspec", "exspec", "ragged"])
def test_generate_writes_one_line_per_request_in_input_order(folders, prompt_file, tmp_path, strategy):
    out = tmp_path / "out.jsonl"
    assert main(["generate", *args(folders, prompt_file, "--strategy", strategy, "--out", str(out))]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in lines] == [f"q{i}" for i in range(len(PROMPTS))]
    assert [x["token_ids"] for x in lines] == expected(folders)
    for x in lines:
        assert x["num_tokens"] == len(x["token_ids"]) and x["stop_reason"] in ("eos", "length") and x["rounds"] >= 1
        # special tokens (EOS, unk) stay in token_ids and are left out of the text a reader sees
        assert x["text"] == " ".join(WORDS[t] for t in x["token_ids"] if t not in (0, 1, EOS))


def test_plain_text_and_spec_bench_prompt_files(folders, tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("\n".join(PROMPTS) + "\n\n")
    bench = tmp_path / "q.jsonl"
    bench.write_text("".join(json.dumps({"question_id": 80 + i, "category": "x", "turns": [p, "again"]}) + "\n"
                             for i, p in enumerate(PROMPTS)))
    outs = []
    for source in (text, bench):
        out = tmp_path / f"{source.stem}.out.jsonl"
        assert main(["generate", *args(folders, source, "--out", str(out))]) == 0
        outs.append([json.loads(x) for x in out.read_text().splitlines()])
    assert [x["token_ids"] for x in outs[0]] == [x["token_ids"] for x in outs[1]] == expected(folders)
    assert [x["id"] for x in outs[1]] == [str(80 + i) for i in range(len(PROMPTS))]


def test_interrupted_run_keeps_its_results_and_resume_completes_it(folders, prompt_file, tmp_path, monkeypatch):
    full = tmp_path / "full.jsonl"
    fixed = ("--policy", "threshold")  # the goodput policy's per-request rounds follow the clock
    assert main(["generate", *args(folders, prompt_file, *fixed, "--out", str(full))]) == 0
    part = tmp_path / "part.jsonl"
    original = specbatch.io.ResultWriter.add
    calls = []

    def add_then_interrupt(self, record):
        original(self, record)
        calls.append(record["id"])
        if len(calls) == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(specbatch.io.ResultWriter, "add", add_then_interrupt)
    assert main(["generate", *args(folders, prompt_file, *fixed, "--out", str(part))]) == 130
    monkeypatch.setattr(specbatch.io.ResultWriter, "add", original)
    kept = [json.loads(x) for x in part.read_text().splitlines()]
    assert len(kept) == 2 and all(k in [json.loads(x) for x in full.read_text().splitlines()] for k in kept)
    with open(part, "a") as f:
        f.write('{"id": "q9", "tok')  # a torn line from a crash
    assert main(["generate", *args(folders, prompt_file, *fixed, "--out", str(part), "--resume")]) == 0
    assert part.read_text() == full.read_text()


def test_verify_reports_exact_match_and_check_trace_accepts_the_trace(folders, prompt_file, tmp_path, capsys):
    assert main(["verify", *args(folders, prompt_file, "--check-invariants")]) == 0
    assert f"exact match: {len(PROMPTS)}/{len(PROMPTS)}" in capsys.readouterr().out
    trace = tmp_path / "trace.jsonl"
    assert main(["generate", *args(folders, prompt_file, "--out", str(tmp_path / "o.jsonl"), "--trace",
                                   str(trace))]) == 0
    assert main(["check-trace", str(trace)]) == 0


def test_verify_flags_an_algorithmic_error(folders, prompt_file, monkeypatch, capsys):
    real = specbatch.api.generate

    def broken(target, draft, prompts, options=None, **kw):  # corrupt the candidate's first token of request 0
        result = real(target, draft, prompts, options, **kw)
        if draft is not None:
            result.sequences[0][0] = (result.sequences[0][0] + 1) % VOCAB
        return result
    monkeypatch.setattr(specbatch.api, "generate", broken)
    assert main(["verify", *args(folders, prompt_file)]) == 1
    assert "ALGORITHMIC ERROR" in capsys.readouterr().out


def test_bench_writes_table_json_and_plots(folders, prompt_file, tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", "--target", folders["target"], "--draft", folders["draft"], "--prompts", str(prompt_file),
                 "--dtype", "float64", "--max-new-tokens", "6", "--batch-sizes", "1,2",
                 "--methods", "ar,spec1,eqspec,exspec,ragged,hf-assisted,bsp-like,dsd-like", "--arrival-rate", "50",
                 "--out-dir", str(out)]) == 0
    data = json.loads((out / "bench.json").read_text())
    methods = {(r["method"], r["batch"]) for r in data["rows"]}
    assert {("ar", 1), ("ar", 2), ("spec1", 1), ("hf-assisted", 1), ("ragged", 2), ("exspec", 2)} <= methods
    assert all(r["exact"] == f"{len(PROMPTS)}/{len(PROMPTS)}" and r["ties"] == r["errors"] == 0
               for r in data["rows"] if "like" not in r["method"])
    broken = [r for r in data["rows"] if "like" in r["method"]]  # their divergences are judged errors, not ties
    assert len(broken) == 4 and min(r["exact_count"] for r in broken) < len(PROMPTS)
    assert all(r["exact_count"] + r["errors"] == len(PROMPTS) and "ERROR" in r["exact"] for r in broken
               if r["exact_count"] < len(PROMPTS))
    assert all(r["vs_ar"] > 0 for r in data["rows"])
    assert "| ragged | 2 |" in (out / "bench.md").read_text()
    assert [r["method"] for r in data["arrivals"]] == ["ar", "eqspec", "exspec", "ragged"]
    assert all(0 < r["p50"] <= r["p90"] <= r["p99"] for r in data["arrivals"])
    assert (out / "throughput.png").stat().st_size > 0 and (out / "breakdown.png").stat().st_size > 0
    from specbatch.cli.bench import report_markdown
    from specbatch.cli.machine import cpu_info
    assert (out / "bench.md").read_text() == report_markdown(data)  # the table is generated from the JSON
    assert data["machine"]["cpu_model"] == cpu_info()["model"] and data["machine"]["threads"] >= 1
    assert data["setup"]["command"].startswith("specbatch bench --target ") and "--arrival-rate 50" in \
        data["setup"]["command"]


def test_bench_runs_the_shipped_prompts_without_a_prompt_file():
    """The default `bench` needs nothing outside the repository: 13 prompts, one per category."""
    from specbatch.cli.bench import SHIPPED_PROMPTS, prompt_categories, select_prompts
    from specbatch.cli.commands import build_parser
    assert build_parser().parse_args(["bench", "--target", "t"]).prompts is None
    prompts = select_prompts(SHIPPED_PROMPTS, 1)
    assert len(prompts) == 13 and len(set(prompt_categories(SHIPPED_PROMPTS))) == 13


def test_bench_alternates_method_order_and_pairs_ratios_by_repeat(folders, prompt_file, tmp_path, capsys):
    """Every second repeat runs target-only last; each repeat's ratio divides by that repeat's own ar run."""
    out = tmp_path / "bench"
    assert main(["bench", "--target", folders["target"], "--draft", folders["draft"], "--prompts", str(prompt_file),
                 "--dtype", "float64", "--max-new-tokens", "4", "--batch-sizes", "2", "--methods", "ar,ragged",
                 "--repeats", "3", "--out-dir", str(out)]) == 0
    order = [line.split("] ")[1] for line in capsys.readouterr().err.splitlines() if line.startswith("[repeat")]
    assert order == ["ar batch 2", "ragged batch 2", "ragged batch 2", "ar batch 2", "ar batch 2", "ragged batch 2"]
    rows = {r["method"]: r for r in json.loads((out / "bench.json").read_text())["rows"]}
    spec, ar = rows["ragged"]["tokens_per_second_runs"], rows["ar"]["tokens_per_second_runs"]
    assert rows["ragged"]["vs_ar_runs"] == pytest.approx([s / a for s, a in zip(spec, ar)])
    assert rows["ragged"]["vs_ar_median"] == pytest.approx(sorted(s / a for s, a in zip(spec, ar))[1])
    assert rows["ar"]["vs_ar_runs"] == pytest.approx([1.0] * 3)
    assert "(1.00x)" in (out / "bench.md").read_text()


def test_bench_judges_a_divergence_at_equal_logits_a_tie_and_a_worse_token_an_error(folders, prompt_file):
    """bench's exact cell: bitwise, else the first divergence judged by the ulp rule (bfloat16 outputs
    differ from batch to batch at equal logits); under sampling nothing is judged."""
    from transformers import AutoModelForCausalLM
    from specbatch.cli.bench import Judge, agreement
    model = AutoModelForCausalLM.from_pretrained(folders["target"], dtype=torch.float64)
    ids = [[2, 5, 7], [3, 4]]
    reference = specbatch.generate(model, None, ids, max_new_tokens=4, batch_size=1, eos_token_id=[]).sequences
    logits = torch.stack([model(torch.tensor([p + r[:1]])).logits[0, -1] for p, r in zip(ids, reference)])
    worst = logits.argmin(-1).tolist()  # after the first token, each request takes its least likely token
    wrong = [r[:1] + [w] + r[2:] for r, w in zip(reference, worst)]
    assert Judge(model, ids, reference, greedy=True)([reference[0], wrong[1]]) == dict(exact=1, ties=0, errors=1)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit equal: any divergence is a tie
        if model.lm_head.bias is not None:
            model.lm_head.bias.zero_()
    assert Judge(model, ids, reference, greedy=True)(wrong) == dict(exact=0, ties=2, errors=0)
    assert Judge(model, ids, reference, greedy=False)(wrong) == dict(exact=0, ties=None, errors=None)
    assert agreement(dict(exact=4, ties=8, errors=1), 13)["exact"] == "4/13 +8 ties, 1 ERROR"
    assert agreement(dict(exact=12, ties=1, errors=0), 13)["exact"] == "12/13 +1 tie"


def test_bench_row_reports_the_repeat_that_agrees_least():
    """A method's exact cell is its worst repeat's: an error in any repeat shows, whatever the others."""
    from specbatch.cli.bench import summary_rows
    timing = dict(tokens_per_second=10.0, mean_accepted_length=1.0, acceptance_rate=0.0, time_draft=0.0,
                  time_verify=1.0, time_align=0.0, time_prefill=0.0, time_total=1.0, align_share=0.0)
    runs = {("ragged", 4): [dict(timing, repeat=0, exact=13, ties=0, errors=0),
                            dict(timing, repeat=1, exact=12, ties=0, errors=1),
                            dict(timing, repeat=2, exact=10, ties=3, errors=0)]}
    [row] = summary_rows(runs, 13)
    assert (row["exact"], row["errors"]) == ("12/13 1 ERROR", 1)
    runs[("ragged", 4)].pop(1)
    assert summary_rows(runs, 13)[0]["exact"] == "10/13 +3 ties"


def test_bench_compares_another_engines_results(folders, prompt_file, tmp_path, capsys):
    """--compare: another engine's tokens/s (its own timing) and its exact match against the reference."""
    want = expected(folders)
    peer = tmp_path / "peer.jsonl"
    lines = [json.dumps({"engine": "fake 1.0", "label": "fake engine", "seconds": 2.0})]
    for i, tokens in enumerate(want):
        wrong = (tokens[:1] + [(tokens[1] + 1) % VOCAB] + tokens[2:]) if i == 2 else tokens
        lines.append(json.dumps({"id": f"q{i}", "token_ids": wrong}))
    peer.write_text("\n".join(lines) + "\n")
    out = tmp_path / "bench"
    assert main(["bench", "--target", folders["target"], "--prompts", str(prompt_file), "--dtype", "float64",
                 "--max-new-tokens", "10", "--batch-sizes", "1", "--methods", "ar", "--compare", str(peer),
                 "--out-dir", str(out)]) == 0
    data = json.loads((out / "bench.json").read_text())
    [row] = data["peers"]
    assert row["exact"] == f"{len(PROMPTS) - 1}/{len(PROMPTS)} 1 ERROR" and (row["ties"], row["errors"]) == (0, 1)
    assert row["tokens_per_second"] == pytest.approx(sum(len(t) for t in want) / 2.0)
    assert "| fake engine |" in (out / "bench.md").read_text()
    bad = tmp_path / "bad_peer.jsonl"
    bad.write_text(json.dumps({"id": "q0", "token_ids": [1]}) + "\n")
    code = main(["bench", "--target", folders["target"], "--prompts", str(prompt_file), "--methods", "ar",
                 "--compare", str(bad), "--out-dir", str(out)])
    assert code == 2 and "header with the engine's 'seconds'" in capsys.readouterr().err


@pytest.mark.parametrize("make,message", [
    (lambda f, p, t: ["--target", str(t / "nope"), "--prompts", str(p)], "no such model folder or file"),
    (lambda f, p, t: ["--target", f["target"], "--prompts", str(t / "missing.jsonl")], "no such prompt file"),
    (lambda f, p, t: ["--target", f["target"], "--prompts", str(t / "empty.txt")], "the prompt file is empty"),
    (lambda f, p, t: ["--target", f["target"], "--prompts", str(t / "bad.jsonl")], "bad.jsonl:2: malformed JSON"),
    (lambda f, p, t: ["--target", f["target"], "--draft", f["other"], "--prompts", str(p)], "vocabularies differ"),
    (lambda f, p, t: ["--target", f["target"], "--prompts", str(t / "long.txt")], "exceed the target's context"),
    (lambda f, p, t: ["--target", f["target"], "--prompts", str(p), "--batch-size", "0"], "positive integer"),
    (lambda f, p, t: ["--target", f["target"], "--prompts", str(p), "--max-new-tokens", "-3"], "positive integer"),
    (lambda f, p, t: ["--target", f["target"], "--prompts", str(p), "--strategy", "magic"], "invalid choice"),
    (lambda f, p, t: ["--target", f["target"], "--prompts", str(p), "--tensor-parallel", "2"],
     "launch with torchrun --nproc-per-node 2"),
])
def test_bad_input_gives_one_line_and_exit_code_2(folders, prompt_file, tmp_path, capsys, make, message):
    (tmp_path / "empty.txt").write_text("\n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "w1"}\n{"prompt": \n')
    (tmp_path / "long.txt").write_text(" ".join(["w5"] * 600) + "\n")
    with pytest.raises(SystemExit) if "positive" in message or "choice" in message else _nothing() as caught:
        code = main(["generate", *make(folders, prompt_file, tmp_path)])
    code = caught.value.code if caught is not None and hasattr(caught, "value") else code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.full  # slow (a subprocess or many runs): the pre-merge profile
def test_subprocess_help_lists_commands_and_errors_have_no_traceback(folders, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "specbatch", *a], capture_output=True, text=True)  # noqa
    helped = run("--help")
    assert helped.returncode == 0
    assert all(c in helped.stdout for c in ("generate", "verify", "bench", "demo", "check-trace"))
    bad = run("generate", "--target", folders["target"], "--prompts", str(tmp_path / "none.jsonl"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "no such prompt file" in bad.stderr


def test_demo_offline_fallback_shows_the_equivalence_check(capsys):
    assert main(["demo", "--offline", "--max-new-tokens", "8"]) == 0
    assert "exact match against target-only greedy decoding at batch 1: 16/16" in capsys.readouterr().out


@pytest.mark.parametrize("draft", ["{draft}+lookup", "lookup", "truncated:1"])
def test_draft_forms_give_target_greedy_output(folders, prompt_file, tmp_path, draft):
    out = tmp_path / "out.jsonl"
    argv = args(folders, prompt_file, "--strategy", "ragged", "--out", str(out))
    argv[argv.index("--draft") + 1] = draft.format(draft=folders["draft"])
    assert main(["generate", *argv]) == 0
    assert [json.loads(x)["token_ids"] for x in out.read_text().splitlines()] == expected(folders)


@pytest.mark.parametrize("draft, message", [("lookup+lookup", "needs a draft model in front"),
                                            ("truncated:x", "positive number of layers"),
                                            ("none+lookup", "needs a draft model in front")])
def test_bad_draft_forms_are_one_line_errors(folders, prompt_file, capsys, draft, message):
    argv = args(folders, prompt_file)
    argv[argv.index("--draft") + 1] = draft
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_peer_that_ran_one_request_at_a_time_is_compared_at_batch_1():
    """bench's table of other engines: a peer whose header says max_num_seqs N is set beside
    specbatch's rows at batch N (when measured), any other peer beside the fastest rows."""
    from specbatch.cli.bench import peer_table
    ours = [dict(method="ar", batch=1, tokens_per_second=20.0), dict(method="ragged", batch=1, tokens_per_second=30.0),
            dict(method="ar", batch=13, tokens_per_second=100.0),
            dict(method="ragged", batch=13, tokens_per_second=110.0)]
    peers = [dict(method="vllm b1", tokens_per_second=10.0, missing=0, exact="13/13", header=dict(max_num_seqs=1)),
             dict(method="vllm", tokens_per_second=50.0, missing=0, exact="13/13", header=dict(max_num_seqs=None)),
             dict(method="vllm b4", tokens_per_second=40.0, missing=0, exact="13/13", header=dict(max_num_seqs=4))]
    one, every, four = peer_table(peers, ours).splitlines()[-3:]
    assert "20.0 (ar, 1) | 2.00x | 30.0 (ragged, 1) | 3.00x" in one and "at most 1 at a time" in one
    assert "100.0 (ar, 13) | 2.00x | 110.0 (ragged, 13) | 2.20x" in every
    assert "100.0 (ar, 13) | 2.50x" in four  # batch 4 was not measured: the fastest rows
