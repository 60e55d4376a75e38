"""The processor vectors (specbatch.conformance.processor_vectors): they hold every class they claim, specbatch's
strategies pass them with speculation on, and every broken engine of specbatch.conformance.testing is flagged."""
import pytest

from hf_models import tiny, word_tokenizer
from profiles import only_full
from specbatch import testing
from specbatch.conformance.greedy import ROUND
from specbatch.conformance.processor_vectors import (CLASSES, STOP_CLASSES, STOP_SPANS, check_processor_outputs,
                                         make_processor_vectors, processors_of)
from specbatch.reference.processors import Processors, processed_greedy_decode, stop_cut

TOKENIZER = word_tokenizer()


def decode(tokens):
    return TOKENIZER.decode(list(tokens), skip_special_tokens=True)


@pytest.fixture(scope="module")
def vectors():
    return make_processor_vectors(tiny("llama"), tokenizer=TOKENIZER)


def test_every_class_is_present_and_does_what_it_claims(vectors):
    from specbatch.conformance.processor_vectors import _logits_fn
    target = tiny("llama")
    logits_of, eos = _logits_fn(target), vectors.manifest["eos_token_ids"]
    assert {r["class"] for r in vectors.requests} == set(CLASSES) | set(STOP_CLASSES)
    assert vectors.manifest["tokenizer"]["tokenizer_class"] == type(TOKENIZER).__name__
    for r in vectors.requests:
        want = vectors.reference[r["id"]]["token_ids"]
        assert want == processed_greedy_decode(logits_of, r["token_ids"], r["max_new_tokens"],
                                               processors_of(r["settings"]), eos, decode)
        if r["class"] in STOP_CLASSES:  # two tokens complete the stop string at the span's end
            start, end = STOP_SPANS[r["class"]]
            stop = r["settings"]["stop"]
            assert len(want) == end and stop_cut(want, decode, stop) == end and stop_cut(want, decode, stop, end - 1)
            assert decode(want[start:end]) == stop[0] and stop[0] not in decode(want[end - 1:end])
            assert vectors.reference[r["id"]]["text"] == decode(want)[:decode(want).find(stop[0])]
            continue
        plain = processed_greedy_decode(logits_of, r["token_ids"], r["max_new_tokens"], Processors(), eos)
        if r["class"].endswith("-in-round"):  # the processors change a draft position of the first round
            first = next(j for j, (a, b) in enumerate(zip(want, plain)) if a != b)
            assert 1 <= first < ROUND
        if r["class"] == "min-tokens-eos":  # EOS held back to token min_tokens, then emitted
            unheld = processed_greedy_decode(logits_of, r["token_ids"], r["max_new_tokens"],
                                             processors_of(dict(r["settings"], min_tokens=0)), eos)
            assert len(unheld) < r["settings"]["min_tokens"] <= len(want) - 1 and want[-1] in eos
    mixed = [r for r in vectors.requests if r["class"] == "mixed"]
    assert len({str(r["settings"]) for r in mixed}) >= 4 and any(r["max_new_tokens"] == 1 for r in mixed)


@pytest.mark.parametrize("strategy", only_full("ragged", "eqspec", "exspec"))
def test_specbatch_passes_with_speculation_on(vectors, strategy):
    target = tiny("llama")
    engine = testing.specbatch_processor_engine(target, target, strategy, num_draft_tokens=4, policy="fixed",
                                                tokenizer=TOKENIZER)
    for report in testing.check_processor_engine(engine, vectors):
        assert report.conformant and all(r["verdict"] == "exact" for r in report.requests)


@pytest.mark.parametrize("bug", sorted(testing.PROCESSOR_BUGS))
def test_every_broken_processor_engine_is_flagged(vectors, bug):
    target = tiny("llama")
    engine = testing.broken_processor_engine(target, target, bug, num_draft_tokens=4, policy="fixed",
                                             tokenizer=TOKENIZER)
    with pytest.raises(testing.ConformanceError, match="ALGORITHMIC") as failure:
        testing.check_processor_engine(engine, vectors)
    if bug == "stop-window-round-only":  # only the stops that span two rounds are missed
        assert "stop-across-rounds" in str(failure.value) and "stop-in-round" not in str(failure.value)


def test_transformers_assisted_generation_on_what_it_can_express(vectors):
    target = tiny("llama")
    engine = testing.hf_assisted_processor_engine(target, tiny("llama", layers=1, seed=5))
    reports = testing.check_processor_engine(engine, vectors, batch_sizes=(1,))
    assert reports[0].conformant and reports[0].warnings  # presence and frequency penalties are left out
    judged = {r["class"] for r in reports[0].requests}
    assert {"repetition-in-round", "min-tokens-eos"} <= judged
    assert not {"frequency-in-round", "presence-in-round", *STOP_CLASSES} & judged


def test_the_checker_names_missing_extra_and_wrong_outputs(vectors):
    rows = [dict(id=r["id"], token_ids=vectors.reference[r["id"]]["token_ids"]) for r in vectors.requests]
    assert check_processor_outputs(vectors, rows).conformant
    first = vectors.requests[0]["id"]
    wrong = [dict(row, token_ids=row["token_ids"] + [0]) if row["id"] == first else row for row in rows]
    report = check_processor_outputs(vectors, wrong)
    assert not report.conformant and report.errors[0]["id"] == first
    report = check_processor_outputs(vectors, rows[1:] + [dict(id="nope", token_ids=[1])])
    assert report.missing == [first] and report.extra == ["nope"]


def test_saved_vectors_read_back_the_same(vectors, tmp_path):
    from specbatch.conformance.greedy import VectorError
    from specbatch.conformance.processor_vectors import load_processor_vectors, save_processor_vectors
    save_processor_vectors(vectors, tmp_path / "v.json")
    again = load_processor_vectors(tmp_path / "v.json")
    assert again.requests == vectors.requests and again.manifest == vectors.manifest
    assert [again.reference[r["id"]]["token_ids"] for r in again.requests] == \
        [vectors.reference[r["id"]]["token_ids"] for r in vectors.requests]
    (tmp_path / "other.json").write_text('{"manifest": {"format": "specbatch-conformance"}}')
    with pytest.raises(VectorError, match="not processor vectors"):
        load_processor_vectors(tmp_path / "other.json")


def test_conform_make_and_check_processor_vectors(folders, tmp_path, capsys):
    """`conform make --processors` writes one file; `conform check` judges outputs against it (exit
    0 conformant, 1 otherwise), and --without leaves out what an engine refuses."""
    import json

    from specbatch.cli.commands import main
    from specbatch.conformance.processor_vectors import load_processor_vectors
    out = tmp_path / "pv.json"
    assert main(["conform", "make", "--processors", "--target", folders["target"], "--dtype", "float64",
                 "--out", str(out)]) == 0
    assert "mixed" in capsys.readouterr().out
    vectors = load_processor_vectors(out)
    rows = [dict(id=r["id"], token_ids=vectors.reference[r["id"]]["token_ids"]) for r in vectors.requests]
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["conform", "check", str(out), str(good)]) == 0
    biased = [r for r in vectors.requests if "logit_bias" in r["settings"]]
    assert biased
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(dict(r, token_ids=r["token_ids"][:-1] if r["id"] == biased[0]["id"]
                                           else r["token_ids"])) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["conform", "check", str(out), str(bad)]) == 1
    assert "ALGORITHMIC" in capsys.readouterr().out
    assert main(["conform", "check", str(out), str(bad), "--without", "logit_bias"]) == 0
    capsys.readouterr()
    assert main(["conform", "make", "--processors", "--target", folders["target"], "--out", str(out)]) == 2
    assert main(["conform", "check", str(out), str(good), "--without", "temperature"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "exists" in err[0] and "unknown setting 'temperature'" in err[1]
