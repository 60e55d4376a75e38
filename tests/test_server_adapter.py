"""The server adapter (`conform run --server`, specbatch.conformance.serving) against an in-process stub server
backed by specbatch (specbatch.conformance.stub_server) on 127.0.0.1: both protocols give the right verdicts,
each switched-on bug class is flagged, user errors are one line with exit 2, and a partial run
resumes without resending finished requests."""
import hashlib
import json
import socket

import pytest
import torch

from hf_models import tiny
from specbatch.cli.commands import main
from specbatch.conformance.greedy import (check_outputs, differential_reference, load_vectors, logprob_tolerance,
                               read_outputs)
from specbatch.conformance.sampled import check_samples, sampled_vectors
from specbatch.conformance.serving import LlamaCppProtocol, ServerEngine, ServerError, run_vectors
from specbatch.conformance.stub_server import StubServer


@pytest.fixture(scope="module")
def pair():
    return tiny("llama"), tiny("llama", layers=1, seed=1)


@pytest.fixture(scope="module")
def vectors(greedy_vectors):
    return load_vectors(greedy_vectors)


def serve(pair, vectors=None, **kw):
    target, draft = pair
    pad = vectors.manifest["pad_token_id"] if vectors is not None else None
    return StubServer(target, draft, pad_token_id=pad, **kw)


def run(pair, vectors, api="openai", bug=None, concurrency=8, **kw):
    with serve(pair, vectors, bug=bug) as server:
        records = run_vectors(ServerEngine(server.url, api, **kw), vectors, concurrency=concurrency)
        return list(records.values()), server.batches


# ---------------------------------------------------------------- greedy verdicts

@pytest.mark.parametrize("api", ["openai", "llama.cpp"])
def test_a_correct_server_conforms_and_batches_concurrent_requests(pair, vectors, api):
    rows, batches = run(pair, vectors, api)
    report = check_outputs(vectors, rows)
    assert report.conformant, report.lines()
    assert all(r["verdict"] == "exact" for r in report.requests)  # float64: no ties
    assert max(batches) > 1 and sum(batches) == len(vectors.requests)  # the server batched what came together


def test_a_server_that_runs_past_eos_is_algorithmic(pair, vectors):
    report = check_outputs(vectors, run(pair, vectors, bug="eos-overrun")[0])
    assert not report.conformant
    overruns = [r for r in report.errors if r["detail"] == "the output continues past the reference's end"]
    stops = {i for i, ref in vectors.reference.items() if ref["stop_reason"] == "eos"}
    assert {r["id"] for r in overruns} == stops and stops  # every request the reference stopped at EOS


def test_a_server_that_masks_from_the_pad_id_is_flagged_in_pad_in_prompt(pair, vectors):
    report = check_outputs(vectors, run(pair, vectors, bug="pad-mask")[0])
    assert not report.conformant
    flagged = {r["id"] for r in report.errors}
    pad = vectors.manifest["pad_token_id"]
    assert any(r["class"] == "pad-in-prompt" for r in report.errors)
    assert all(pad in r["token_ids"] for r in vectors.requests if r["id"] in flagged)  # only prompts holding it


def test_llama_cpp_states_that_it_cannot_judge_stop_ids(pair, vectors):
    """llama.cpp takes no stop token ids: answers are cut here, so an overrun is not seen, and says so."""
    rows, _ = run(pair, vectors, "llama.cpp", bug="eos-overrun")
    assert check_outputs(vectors, rows).conformant
    assert any("stop token ids" in line for line in ServerEngine("http://127.0.0.1:1", "llama.cpp").limits)
    assert not ServerEngine("http://127.0.0.1:1", "openai").limits


def test_the_server_engine_is_an_engine_of_the_kit(pair, vectors, monkeypatch):
    import urllib.request
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # a proxy in the environment: loopback is reached directly
    monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen's cached opener would hide the environment
    with serve(pair) as server:
        engine = ServerEngine(server.url)
        got = engine(vectors.prompts[:6], vectors.budgets[:6], vectors.manifest["eos_token_ids"], batch_size=3)
    want = [vectors.reference[r["id"]]["token_ids"] for r in vectors.requests[:6]]
    assert got == want


# ---------------------------------------------------------------- the differential check

@pytest.mark.full  # slow (a subprocess or many runs): the pre-merge profile
def test_differential_check_against_the_engines_own_run(pair, vectors):
    """Reference: one request at a time with logprobs; configured: concurrent. Equal, and a changed
    token is a tie or algorithmic by the engine's own logprob margin there."""
    reference_rows, _ = run(pair, vectors, concurrency=1, logprobs=4)
    rows, _ = run(pair, vectors, concurrency=8)
    reference = differential_reference(vectors, reference_rows)
    assert check_outputs(vectors, rows, reference=reference).conformant
    # the closest call of the reference run: a position whose top-2 logprob gap is the smallest
    row, index = min(((r, i) for r in reference_rows for i in range(len(r["top"])) if i < len(r["token_ids"])),
                     key=lambda pair: pair[0]["top"][pair[1]][0][1] - pair[0]["top"][pair[1]][1][1])
    top = row["top"][index]
    assert top[0][0] == row["token_ids"][index]  # greedy: the chosen token leads its logprobs
    changed = [dict(r) for r in rows]
    mine = next(r for r in changed if r["id"] == row["id"])
    mine["token_ids"] = mine["token_ids"][:index] + [top[1][0]]
    gap = top[0][1] - top[1][1]
    tie = check_outputs(vectors, changed, reference=reference, tolerance=gap * 1.001)
    assert tie.conformant and [r["verdict"] for r in tie.requests if r["id"] == row["id"]] == ["tie"]
    wrong = check_outputs(vectors, changed, reference=reference, tolerance=gap * 0.999)
    assert [r["id"] for r in wrong.errors] == [row["id"]]
    mine["token_ids"] = mine["token_ids"][:index] + [next(t for t in range(10**6) if t not in dict(top))]
    assert not check_outputs(vectors, changed, reference=reference, tolerance=1.0).conformant  # outside the top
    assert logprob_tolerance("float32", 512) == pytest.approx(512 * 2 ** -23 * 32)


def test_the_differential_default_tolerance_is_the_logprob_rule(vectors):
    """Without --tie-tolerance, a differential check allows logprob_tolerance (float64 vectors: 4096
    ulps at a logit of 32), not the ulp rule at the top logprob (near 0, where an ulp is tiny)."""
    request = next(r for r in vectors.requests if vectors.reference[r["id"]]["token_ids"])
    rows = [dict(id=r["id"], token_ids=vectors.reference[r["id"]]["token_ids"]) for r in vectors.requests]
    reference = {r["id"]: dict(r, top=[]) for r in rows}
    want = reference[request["id"]]["token_ids"][0]
    other = (want + 1) % vectors.manifest["vocab_size"]
    gap = logprob_tolerance(vectors.manifest["dtype"], vectors.manifest["tie_ulps_default"]) / 2
    reference[request["id"]]["top"] = [[[want, -0.5], [other, -0.5 - gap]]]
    mine = next(r for r in rows if r["id"] == request["id"])
    mine["token_ids"] = [other]
    report = check_outputs(vectors, rows, reference=reference)
    assert [r["verdict"] for r in report.requests if r["id"] == request["id"]] == ["tie"], report.lines()
    assert report.tolerance == logprob_tolerance(vectors.manifest["dtype"], vectors.manifest["tie_ulps_default"])


def test_a_reference_run_without_logprobs_judges_every_divergence_algorithmic(pair, vectors):
    rows, _ = run(pair, vectors, concurrency=8)
    reference = differential_reference(vectors, rows)
    changed = [dict(r) for r in rows]
    victim = next(r for r in changed if len(r["token_ids"]) > 1)
    victim["token_ids"] = [victim["token_ids"][0] + 1] + victim["token_ids"][1:]
    report = check_outputs(vectors, changed, reference=reference, tolerance=1.0)
    assert [r["id"] for r in report.errors] == [victim["id"]]


# ---------------------------------------------------------------- sampled verdicts through a server

@pytest.fixture(scope="module")
def sampled_pair():
    return tiny("llama", seed=0, dtype=torch.float32), tiny("llama", layers=1, seed=1, dtype=torch.float32)


@pytest.mark.parametrize("api,bug", [("openai", None), pytest.param("llama.cpp", None, marks=pytest.mark.full),
                                     ("openai", "shared-seed"),
                                     pytest.param("openai", "wrong-top-p", marks=pytest.mark.full)])
@pytest.mark.full  # slow (a subprocess or many runs): the pre-merge profile
def test_sampled_vectors_through_a_server(sampled_pair, api, bug):
    target, draft = sampled_pair
    vectors = sampled_vectors(target, seed=4, samples=32)
    with StubServer(target, draft, bug=bug) as server:
        rows = list(run_vectors(ServerEngine(server.url, api), vectors, concurrency=8).values())
    report = check_samples(vectors, rows, target, batch_size=8)
    assert report.conformant == (bug is None), report.table()
    if bug == "shared-seed":
        assert min(p for name, p in report.p_values() if "independence" in name) < report.threshold


def test_a_server_that_changes_a_sampling_parameter_is_refused(sampled_pair):
    target, draft = sampled_pair
    vectors = sampled_vectors(target, seed=4, samples=4)
    with StubServer(target, draft, bug="drops-top-k") as server:
        with pytest.raises(ServerError, match="changed parameter 'top_k': sent 0, it used 40"):
            run_vectors(ServerEngine(server.url, "llama.cpp"), vectors, concurrency=4)
    assert "top_k" in LlamaCppProtocol.ECHOED


# ---------------------------------------------------------------- the command line

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def one_line_error(capsys, argv, *needles):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's refusals
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "Traceback" not in err, err  # progress lines may come before it
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize("bug,needle", [("text-only", "text without token ids"),
                                        ("text-prompt", "did not take the prompt as token ids")])
def test_unusable_servers_are_one_line_errors(pair, vectors, greedy_vectors, tmp_path, capsys, bug, needle):
    out = tmp_path / "o.jsonl"
    with serve(pair, vectors, bug=bug) as server:
        line = one_line_error(capsys, ["conform", "run", str(greedy_vectors), "--server", server.url,
                                       "--out", str(out)], needle, "--resume sends the rest")
    assert line.count("error:") == 1 and out.read_text() == ""  # no unusable answer kept


def test_an_unreachable_server_is_one_line(greedy_vectors, tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    line = one_line_error(capsys, ["conform", "run", str(greedy_vectors), "--server", url, "--retries", "1",
                                   "--out", str(tmp_path / "o.jsonl")], "cannot reach the server", "after 2 attempts")
    assert "0 of 59 results are in" in line
    one_line_error(capsys, ["conform", "run", str(greedy_vectors), "--server", "ftp://x", "--out",
                            str(tmp_path / "o.jsonl")], "not an http")
    one_line_error(capsys, ["conform", "run", str(greedy_vectors), "--server", url, "--extra", "[1]", "--out",
                            str(tmp_path / "x.jsonl")], "--extra must be a JSON object")
    assert not (tmp_path / "x.jsonl").exists()  # refused before anything is written


def test_a_refused_parameter_is_named(pair, greedy_vectors, tmp_path, capsys):
    with serve(pair) as server:
        line = one_line_error(capsys, ["conform", "run", str(greedy_vectors), "--server", server.url, "--extra",
                                       '{"prompt": "text"}', "--out", str(tmp_path / "o.jsonl")],
                              "HTTP 400", "prompt must be a list of token ids", "(parameter 'prompt')")
        assert server.batches == []  # the server ran nothing
    assert line.endswith("--resume sends the rest)")


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_the_tie_tolerance_must_be_finite_and_non_negative(greedy_vectors, tmp_path, capsys, value):
    outputs = tmp_path / "o.jsonl"
    outputs.write_text("")
    one_line_error(capsys, ["conform", "check", str(greedy_vectors), str(outputs), "--tie-tolerance", value],
                   "--tie-tolerance")


@pytest.mark.full  # slow (a subprocess or many runs): the pre-merge profile
def test_run_check_resume_and_no_silent_overwrite(pair, vectors, greedy_vectors, tmp_path, capsys):
    out = tmp_path / "outputs.jsonl"
    with serve(pair, vectors) as server:
        base = ["conform", "run", str(greedy_vectors), "--server", server.url, "--concurrency", "4"]
        assert main(base + ["--out", str(out)]) == 0
        whole = out.read_text()
        served = sum(server.batches)
        assert served == len(vectors.requests)
        assert main(["conform", "check", str(greedy_vectors), str(out)]) == 0
        assert "CONFORMANT" in capsys.readouterr().out
        # an existing file is not replaced without being asked
        before = digest(out)
        one_line_error(capsys, base + ["--out", str(out)], "already holds results", "--resume", "--overwrite")
        assert digest(out) == before
        # a partial file (an interrupted run: 10 results and a torn line) is completed, resending only the rest
        lines = whole.splitlines(keepends=True)
        out.write_text("".join(lines[:10]) + lines[10][:15])
        assert main(base + ["--out", str(out), "--resume"]) == 0
        assert sum(server.batches) - served == len(vectors.requests) - 10
        assert out.read_text() == whole
        # a resume with other settings is refused
        one_line_error(capsys, base + ["--out", str(out), "--resume", "--logprobs", "2"], "other settings")
        assert main(base + ["--out", str(out), "--overwrite", "--logprobs", "2"]) == 0
    rows, _ = read_outputs(out)
    assert all(len(r["top"]) == len(r["token_ids"]) for r in rows)
    # the differential check from the command line: against itself, with its tolerance said
    capsys.readouterr()
    assert main(["conform", "check", str(greedy_vectors), str(out), "--against", str(out)]) == 0
    assert "the engine's own run" in capsys.readouterr().out
    broken = [dict(r) for r in rows]
    broken[0]["token_ids"] = broken[0]["token_ids"] + [0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in broken))
    assert main(["conform", "check", str(greedy_vectors), str(bad), "--against", str(out)]) == 1
    one_line_error(capsys, ["conform", "check", str(greedy_vectors), str(out), "--against", str(tmp_path / "x")],
                   "x")


def test_a_refusal_names_a_parameter_only_when_its_message_does():
    from specbatch.conformance.serving import _parameter_hint
    body = dict(n=1, top_k=5, seed=3, prompt=[1])
    assert _parameter_hint("EngineCore encountered an issue", body) == ""  # no stray one-letter match
    assert _parameter_hint("top_k must be at least -1", body) == " (parameter 'top_k')"
    assert "--no-seeds" in _parameter_hint("seed is not supported", body)


# ---------------------------------------------------------------- processors through a server

@pytest.fixture(scope="module")
def processor_vectors(pair):
    from specbatch.conformance.processor_vectors import make_processor_vectors
    return make_processor_vectors(pair[0])


@pytest.mark.parametrize("bug", [None, "processors-ignored"])
def test_processor_vectors_through_a_server(pair, processor_vectors, bug):
    """Every request with its own penalties, bias and min_tokens, sent together to an OpenAI server
    (which batches requests of different settings): exact when it applies them, flagged when it
    accepts them and applies none (SGLang issue 28180's class)."""
    from specbatch.conformance.processor_vectors import check_processor_outputs
    with StubServer(*pair, bug=bug) as server:
        rows = list(run_vectors(ServerEngine(server.url, "openai"), processor_vectors, concurrency=8).values())
        assert max(server.batches) > 1
    report = check_processor_outputs(processor_vectors, rows)
    assert report.conformant == (bug is None), report.lines()
    if bug:
        wrong = {r["id"] for r in report.requests if r["verdict"] != "exact"}
        assert wrong and all(not processor_vectors.requests[i]["settings"] or r["verdict"] == "exact"
                             for i, r in enumerate(report.requests) if r["id"] not in wrong)
        assert {r["class"] for r in report.requests if r["id"] in wrong} >= {"repetition-in-round", "bias-in-round"}


def test_llama_cpp_leaves_out_what_it_cannot_express_and_says_so(pair, processor_vectors, tmp_path, capsys):
    """llama.cpp's API has logit_bias and min_p only: conform run sends the rest, names what it left
    out and the --without that judges the rest; conform check with it passes."""
    from specbatch.conformance.processor_vectors import save_processor_vectors
    path = tmp_path / "processors.json"
    save_processor_vectors(processor_vectors, path)
    out = tmp_path / "out.jsonl"
    with StubServer(*pair) as server:
        assert main(["conform", "run", str(path), "--server", server.url, "--api", "llama.cpp", "--out", str(out)]) == 0
        sent = sum(server.batches)
    captured = capsys.readouterr()
    assert "cannot express repetition_penalty,presence_penalty,frequency_penalty,min_tokens,stop" in captured.err
    expressible = [r for r in processor_vectors.requests if set(r["settings"]) <= {"logit_bias"}]
    assert sent == len(expressible) and any(r["settings"] for r in expressible)
    assert "--without repetition_penalty,presence_penalty,frequency_penalty,min_tokens,stop" in captured.out
    without = "repetition_penalty,presence_penalty,frequency_penalty,min_tokens,stop"
    assert main(["conform", "check", str(path), str(out), "--without", without]) == 0
    assert main(["conform", "check", str(path), str(out)]) == 1  # the left-out requests are missing
    with pytest.raises(ServerError, match="cannot express min_tokens"):
        ServerEngine("http://127.0.0.1:9", "llama.cpp").protocol.body(
            __import__("specbatch.conformance.serving", fromlist=["Ask"]).Ask("x", [1], 2, [0], processors=dict(min_tokens=2)), 0,
            None)


@pytest.mark.parametrize("bug", [None, pytest.param("processors-ignored", marks=pytest.mark.full)])
def test_sampled_processor_vectors_through_a_server(sampled_pair, bug):
    target, draft = sampled_pair
    with torch.no_grad():  # peaked: on a random model's near-uniform distributions processors move little mass
        target = __import__("copy").deepcopy(target)
        target.lm_head.weight.mul_(30.0)
    vectors = sampled_vectors(target, seed=4, samples=32 if bug is None else 64, processors=True).subset(
        settings=["t1.0-bias", "t1.0-minp0.1"] if bug is None else ["t1.0-rep1.5", "t1.0-bias"])
    with StubServer(target, target, bug=bug) as server:
        rows = list(run_vectors(ServerEngine(server.url, "openai"), vectors, concurrency=8).values())
    report = check_samples(vectors, rows, target, batch_size=8)
    assert report.conformant == (bug is None), report.table()


@pytest.mark.parametrize("bug", [None, "draft-logprobs"])
def test_logprobs_of_processor_vectors_through_a_server(pair, processor_vectors, bug, tmp_path, capsys):
    """conform check --logprobs raw compares the logprob the server returned for each token with the
    reference's: a server returning the draft's logprobs is flagged; a correct server's raw logprobs
    are not its processed ones wherever processors change the logits."""
    from specbatch.conformance.processor_vectors import check_processor_outputs, save_processor_vectors
    with StubServer(*pair, bug=bug) as server:
        rows = list(run_vectors(ServerEngine(server.url, "openai", logprobs=2), processor_vectors,
                                concurrency=8).values())
    report = check_processor_outputs(processor_vectors, rows, logprobs="raw")
    assert report.conformant == (bug is None), report.lines()
    assert not report.warnings
    if bug:
        assert report.errors and all("raw logprob" in r["detail"] for r in report.errors)
        assert check_processor_outputs(processor_vectors, rows).conformant  # the tokens themselves are right
    else:
        processed = check_processor_outputs(processor_vectors, rows, logprobs="processed")
        changed = {r["id"] for r in processor_vectors.requests if r["settings"]}
        assert processed.errors and {r["id"] for r in processed.errors} <= changed
        path, out = tmp_path / "pv.json", tmp_path / "out.jsonl"
        save_processor_vectors(processor_vectors, path)
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert main(["conform", "check", str(path), str(out), "--logprobs", "raw"]) == 0
        assert main(["conform", "check", str(path), str(out), "--logprobs", "processed"]) == 1
        assert "processed logprob of token" in capsys.readouterr().out


@pytest.mark.parametrize("bug", [None, "draft-logprobs"])
def test_logprobs_of_greedy_vectors_through_a_server(pair, vectors, greedy_vectors, bug, tmp_path, capsys):
    """conform check --logprobs on greedy vectors: each returned logprob against the reference's
    (the vectors keep every answer token's); a server returning its draft's is flagged, though its
    tokens are right."""
    rows, _ = run(pair, vectors, bug=bug, logprobs=2)
    report = check_outputs(vectors, rows, logprobs="raw")
    assert report.conformant == (bug is None), report.table()
    assert not report.warnings
    if bug:
        assert report.errors and all("raw logprob" in r["detail"] for r in report.errors)
        assert check_outputs(vectors, rows).conformant  # the tokens themselves are right
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["conform", "check", str(greedy_vectors), str(out), "--logprobs", "raw"]) == (1 if bug else 0)
    assert ("raw logprob of token" in capsys.readouterr().out) == bool(bug)


def test_a_returned_logprob_off_by_more_than_the_tolerance_is_flagged(pair, vectors):
    """The logprob judge at its threshold: off by the tolerance passes, by twice it fails; a missing
    number in the reference run's place is a warning, not a pass (vectors made before version 5)."""
    rows, _ = run(pair, vectors, logprobs=1)
    tolerance = logprob_tolerance(vectors.manifest["dtype"], vectors.manifest["tie_ulps_default"])
    victim = next(r for r in rows if len(r["token_ids"]) > 2)
    for shift, conformant in ((0.9 * tolerance, True), (2 * tolerance, False)):
        edited = [dict(r, logprobs=[lp + (shift if r is victim and j == 2 else 0.0) for j, lp in enumerate(
            dict(pairs)[t] for t, pairs in zip(r["token_ids"], r["top"]))]) for r in rows]
        for r in edited:
            r.pop("top")
        report = check_outputs(vectors, edited, logprobs="processed")
        assert report.conformant == conformant
        if not conformant:
            assert [(r["id"], r["index"]) for r in report.errors] == [(victim["id"], 2)]
    old = __import__("copy").deepcopy(vectors)
    for ref in old.reference.values():
        ref.pop("logprobs")
    report = check_outputs(old, rows, logprobs="raw")
    assert report.conformant and report.warnings and "made before they were kept" in report.warnings[0]


@pytest.mark.parametrize("api", ["openai", "llama.cpp"])
@pytest.mark.parametrize("bug", [None, "draft-logprobs"])
def test_logprobs_of_sampled_vectors_through_a_server(sampled_pair, bug, api):
    """The sampled checker compares each returned logprob with the target's at that row's own prefix:
    raw passes for a correct server and flags one returning its draft's; the correct server's raw
    numbers are not the processed ones wherever temperature or truncation change the distribution.
    llama.cpp returns the top n and, beside them, the chosen token's own logprob: a sampled token
    outside the top n is still checked."""
    target, draft = sampled_pair
    vectors = sampled_vectors(target, seed=4, samples=16).subset(settings=["t0.7", "t1.0-k5"])
    with StubServer(target, draft, bug=bug) as server:
        rows = list(run_vectors(ServerEngine(server.url, api, logprobs=1), vectors, concurrency=8).values())
    if api == "llama.cpp":  # some sampled tokens are not the most likely: their logprob came beside the top 1
        assert any(len(top) > 1 for r in rows for top in r["top"])
    report = check_samples(vectors, rows, target, batch_size=8, logprobs="raw")
    assert report.logprobs_checked == sum(len(r["token_ids"]) for r in rows)
    assert report.conformant == (bug is None), report.lines()
    assert bool(report.logprob_errors) == bool(bug)
    if bug:
        assert report.p_value() == 0 and "raw logprob of token" in report.lines()[0]
        assert check_samples(vectors, rows, target, batch_size=8).conformant  # the samples themselves are right
    else:
        processed = check_samples(vectors, rows, target, batch_size=8, logprobs="processed")
        assert processed.logprob_errors and not processed.conformant
        no_numbers = [{k: v for k, v in r.items() if k not in ("top", "logprobs")} for r in rows]
        assert any("no raw logprob" in e for e in check_samples(vectors, no_numbers, target, batch_size=8,
                                                               logprobs="raw").errors)
        numbers = [dict(no_numbers[i], logprobs=[dict(pairs)[t] for t, pairs in zip(r["token_ids"], r["top"])])
                   for i, r in enumerate(rows)]
        victim = next(r for r in numbers if len(r["token_ids"]) > 3)
        for shift, wrong in ((0.9 * report.logprob_tolerance, []), (2 * report.logprob_tolerance, [victim["id"]])):
            edited = [dict(r, logprobs=[v + (shift if r is victim and j == 3 else 0.0) for j, v in
                                        enumerate(r["logprobs"])]) for r in numbers]
            again = check_samples(vectors, edited, target, batch_size=8, logprobs="raw")
            assert [(e[0], e[1]) for e in again.logprob_errors] == [(i, 3) for i in wrong]
