"""Careless and hostile input: every user error is one line on stderr and exit 2, nothing outside
--out and --trace is written, and results survive a kill or a full disk (README, "Errors")."""
import errno
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import specbatch
import specbatch.io
from hf_models import EOS, PROMPTS, VOCAB, tiny
from specbatch.cli.commands import main
from specbatch.options import OptionError


def run_cli(*argv):
    """(exit code, stderr lines) of the CLI as a subprocess."""
    done = subprocess.run([sys.executable, "-m", "specbatch", *argv], capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr.strip().splitlines()


def gen_args(folders, prompts, *extra):
    return ["generate", "--target", folders["target"], "--draft", folders["draft"], "--prompts", str(prompts),
            "--dtype", "float64", "--max-new-tokens", "6", "--batch-size", "3",
            "--policy", "threshold", *extra]  # the goodput policy's per-request rounds follow the clock


def one_line_exit_2(capsys, argv, message):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's verdict on a malformed value
        code = e.code
    err = [x for x in capsys.readouterr().err.strip().splitlines()  # minus tqdm's lines (req/s, or s/req when slow)
           if "req/s" not in x and "s/req" not in x and x.strip()]
    assert code == 2, err
    assert len(err) == 1 and "Traceback" not in err[0], err
    return message in err[0]  # callers assert it: the one line names the problem


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


# ---------------------------------------------------------------- output paths

@pytest.mark.full  # eight CLI subprocesses
def test_outputs_never_replace_what_they_do_not_own(folders, prompt_file, tmp_path):
    """The prompt file, a symlink's target, a FIFO and a directory survive every attempt to write over
    them; each attempt is one line and exit 2, before any model is loaded."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(victim)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    before = {p: digest(p) for p in (prompt_file, victim)}
    cases = [
        (["--out", str(prompt_file)], "is the same file as --prompts"),
        (["--trace", str(prompt_file)], "is the same file as --prompts"),
        (["--out", str(link)], "is a symlink"),
        (["--out", str(fifo)], "not a regular file"),
        (["--trace", str(fifo)], "not a regular file"),
        (["--out", str(folder)], "is a directory"),
        (["--out", str(tmp_path / "o.jsonl"), "--trace", str(tmp_path / "o.jsonl")], "is the same file as --trace"),
        (["--out", str(tmp_path / "missing" / "o.jsonl")], "does not exist"),
    ]
    for extra, message in cases:
        code, err = run_cli(*gen_args(folders, prompt_file, *extra))
        assert code == 2 and len(err) == 1 and message in err[0], (extra, err)
    assert {p: digest(p) for p in (prompt_file, victim)} == before
    assert link.is_symlink() and fifo.is_fifo() and folder.is_dir() and not (tmp_path / "o.jsonl").exists()


def test_a_full_disk_is_one_line_and_resume_completes_to_the_same_bytes(folders, prompt_file, tmp_path,
                                                                       monkeypatch, capsys):
    whole = tmp_path / "whole.jsonl"
    assert main(gen_args(folders, prompt_file, "--out", str(whole))) == 0
    out = tmp_path / "out.jsonl"
    original, writes = specbatch.io.ResultWriter.add, []

    def add(self, record):  # the disk fills up after two results
        if len(writes) == 2:
            raise specbatch.io.OutputError(f"cannot write results to {self.path}: "
                                           f"{os.strerror(errno.ENOSPC)}; the results written before stay there")
        writes.append(record["id"])
        original(self, record)
    monkeypatch.setattr(specbatch.io.ResultWriter, "add", add)
    capsys.readouterr()
    assert one_line_exit_2(capsys, gen_args(folders, prompt_file, "--out", str(out)), "No space left on device")
    kept = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert sorted(kept) == sorted(writes) and len(kept) == 2
    monkeypatch.setattr(specbatch.io.ResultWriter, "add", original)
    assert main(gen_args(folders, prompt_file, "--out", str(out), "--resume")) == 0
    assert out.read_bytes() == whole.read_bytes()


def test_a_real_write_error_is_reported_by_the_writer(tmp_path):
    writer = specbatch.io.ResultWriter(tmp_path / "r.jsonl", ["a"], {})
    writer.file.close()
    writer.file = open("/dev/full", "w")  # every write: ENOSPC
    with pytest.raises(specbatch.io.OutputError, match="No space left on device"):
        writer.add(dict(id="a", token_ids=[1]))


@pytest.mark.full  # a subprocess killed and resumed
def test_a_run_killed_mid_way_resumes_to_the_same_bytes(folders, prompt_file, tmp_path):
    whole = tmp_path / "whole.jsonl"
    assert run_cli(*gen_args(folders, prompt_file, "--out", str(whole), "--batch-size", "1"))[0] == 0
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "specbatch", *gen_args(folders, prompt_file, "--out", str(out), "--batch-size", "1")]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or not out.read_text().count("\n")):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 1 <= out.read_text().count("\n") < len(PROMPTS) + 1
    assert run_cli(*gen_args(folders, prompt_file, "--out", str(out), "--batch-size", "1", "--resume"))[0] == 0
    assert out.read_bytes() == whole.read_bytes()


# ---------------------------------------------------------------- numbers

@pytest.mark.parametrize("extra,message", [
    (["--temperature", "nan"], "temperature must be a finite number"),
    (["--temperature", "inf"], "temperature must be a finite number"),
    (["--temperature", "-1"], "temperature must be a finite number"),
    (["--temperature", "1", "--top-p", "0"], "top_p must be a finite number in (0.0, 1.0]"),
    (["--temperature", "1", "--top-p", "nan"], "top_p must be a finite number"),
    (["--seed", str(2**70)], "seed must be an integer in [0, 9223372036854775807]"),
    (["--seed", "-1"], "seed must be an integer"),
    (["--draft-threshold", "nan"], "probability"),
    (["--draft-floor", "1.5"], "probability"),
    (["--draft-threshold", "0.5", "--draft-floor", "0.6"], "draft_floor must be <= draft_threshold (0.5)"),
])
def test_numbers_out_of_range_are_named(folders, prompt_file, capsys, extra, message):
    assert one_line_exit_2(capsys, gen_args(folders, prompt_file, *extra), message)


@pytest.mark.parametrize("rate", ["nan", "-1", "0", "inf"])
def test_bench_arrival_rate_is_checked_before_anything_runs(folders, prompt_file, tmp_path, capsys, rate):
    assert one_line_exit_2(capsys, ["bench", "--target", folders["target"], "--prompts", str(prompt_file),
                             "--out-dir", str(tmp_path / "b"), "--arrival-rate", rate], "arrival_rate must be")
    assert not (tmp_path / "b").exists()


def test_the_api_gives_the_same_verdicts():
    target = tiny("llama")
    prompts = [[5, 6, 7], [8]]
    bad = [
        (dict(temperature=float("nan")), "temperature must be a finite number"),
        (dict(temperature=float("inf")), "temperature must be a finite number"),
        (dict(temperature=1.0, top_p=0.0), "top_p must be a finite number in (0.0, 1.0]"),
        (dict(seed=2**70), "seed must be an integer in [0, 9223372036854775807]"),
        (dict(arrivals=[0.0, float("nan")]), "arrivals[1] must be a finite number"),
        (dict(arrivals=[0.0, -1.0]), "arrivals[1] must be a finite number"),
        (dict(eos_token_id="25"), "eos_token_id must be an integer token id"),
        (dict(eos_token_id=[2.0]), "eos_token_id must be an integer token id"),
        (dict(pad_token_id=-5), "pad_token_id must be an integer token id in [0, 96)"),
        (dict(pad_token_id=VOCAB), "pad_token_id must be an integer token id"),
        (dict(draft_floor=0.8), "draft_floor must be <= draft_threshold (0.7)"),
        (dict(draft_floor=-0.1), "draft_floor must be a finite number in [0.0, 1.0]"),
    ]
    for kwargs, message in bad:
        with pytest.raises(OptionError) as caught:
            specbatch.generate(target, None, prompts, max_new_tokens=3, **kwargs)
        assert message in str(caught.value), (kwargs, str(caught.value))
    with pytest.raises(ValueError, match=r"prompt 1 has token id 8.5, not an integer"):
        specbatch.generate(target, None, [[5, 6], [7, 8.5]], max_new_tokens=3)
    with pytest.raises(ValueError, match="target is float32 but draft is float64"):
        specbatch.generate(tiny("llama", dtype=torch.float32), tiny("llama", layers=1), prompts, max_new_tokens=3)


def test_a_huge_ragged_batch_uses_only_the_slots_it_needs():
    target = tiny("llama")
    result = specbatch.generate(target, None, [[5, 6, 7], [8]], max_new_tokens=4, batch_size=10**9,
                                strategy="ragged", eos_token_id=EOS)
    small = specbatch.generate(target, None, [[5, 6, 7], [8]], max_new_tokens=4, batch_size=2, strategy="ragged",
                               eos_token_id=EOS)
    assert result.sequences == small.sequences


# ---------------------------------------------------------------- reading files

def test_a_byte_order_mark_and_a_raw_line_separator_are_read_right(folders, prompt_file, tmp_path):
    plain = tmp_path / "plain.jsonl"
    assert main(gen_args(folders, prompt_file, "--out", str(plain))) == 0
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + prompt_file.read_bytes())
    out = tmp_path / "out.jsonl"
    assert main(gen_args(folders, bom, "--out", str(out))) == 0
    assert out.read_bytes() == plain.read_bytes()
    sep = tmp_path / "sep.jsonl"  # json.dumps(ensure_ascii=False) writes U+2028 raw
    sep.write_text(json.dumps({"id": "a", "prompt": "w10\u2028w11"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert specbatch.io.read_prompts(sep) == [("a", "w10\u2028w11")]
    text = tmp_path / "p.txt"
    text.write_text("w10 w11\fw12\nw13\n")
    assert specbatch.io.read_prompts(text) == [("0", "w10 w11\fw12"), ("1", "w13")]


def test_a_jsonl_file_of_non_objects_is_an_error(folders, tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text("w10 w11\nw12\n")
    assert one_line_exit_2(capsys, gen_args(folders, bad), "p.jsonl:1: malformed JSON")


@pytest.mark.parametrize("content,message", [
    ('{"id": "q0", "token_ids": [1]}\n{"id": "zz", "token_ids": [2]}\n', "'zz' is not in the prompt file"),
    ('{"id": "q1"}\n', "has no 'token_ids' list of integers"),
    ('{"id": "q1", "token_ids": [1.5]}\n', "has no 'token_ids' list of integers"),
    (b'{"id": "q1", "token_ids": [1]}\n\xff\n', "not a UTF-8 text results file"),
    ('[1, 2]\n{"id": "q1", "token_ids": [1]}\n', "must be a JSON object with an 'id'"),
    ('{"id": "q1", "token_ids": [1]}\n{"id": "q1", "token_ids": [1]}\n', "appears twice"),
])
def test_resume_refuses_results_it_cannot_trust_and_keeps_them(folders, prompt_file, tmp_path, capsys, content,
                                                                message):
    out = tmp_path / "out.jsonl"
    out.write_bytes(content if isinstance(content, bytes) else content.encode())
    before = digest(out)
    assert one_line_exit_2(capsys, gen_args(folders, prompt_file, "--out", str(out), "--resume"), message)
    assert digest(out) == before


def test_a_torn_last_result_line_is_regenerated(folders, prompt_file, tmp_path):
    whole = tmp_path / "whole.jsonl"
    assert main(gen_args(folders, prompt_file, "--out", str(whole))) == 0
    lines = whole.read_text().splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    out.write_text("".join(lines[:2]) + lines[2][:15])  # a crash mid-line
    shutil.copy(f"{whole}.settings.json", f"{out}.settings.json")  # the same run's record
    assert main(gen_args(folders, prompt_file, "--out", str(out), "--resume")) == 0
    assert out.read_bytes() == whole.read_bytes()


# ---------------------------------------------------------------- models and other commands

def test_model_and_device_problems_are_one_line(folders, prompt_file, tmp_path, capsys):
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text(open(os.path.join(folders["target"], "config.json")).read())
    assert one_line_exit_2(capsys, gen_args(dict(folders, target=str(empty)), prompt_file), "cannot load the model in")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for name in os.listdir(folders["target"]):
        data = open(os.path.join(folders["target"], name), "rb").read()
        (corrupt / name).write_bytes(data[: len(data) // 2] if name.endswith(".safetensors") else data)
    assert one_line_exit_2(capsys, gen_args(dict(folders, target=str(corrupt)), prompt_file), "cannot load the model in")
    assert one_line_exit_2(capsys, gen_args(dict(folders, draft="truncated:100"), prompt_file),
                    "the target has 2 layers; a truncated draft keeps fewer")
    if not torch.cuda.is_available():
        assert one_line_exit_2(capsys, gen_args(folders, prompt_file, "--device", "cuda"), "CUDA is not available")
    assert one_line_exit_2(capsys, gen_args(folders, prompt_file, "--device", "warp-drive"), "not a device torch knows")


def test_chat_template_without_one_and_per_category_on_text(folders, prompt_file, tmp_path, capsys):
    bare = tmp_path / "bare"
    import shutil
    shutil.copytree(folders["target"], bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    assert one_line_exit_2(capsys, gen_args(dict(folders, target=str(bare)), prompt_file, "--chat-template"),
                    "has no chat template")
    text = tmp_path / "p.txt"
    text.write_text("w10 w11\nw12\n")
    assert one_line_exit_2(capsys, ["bench", "--target", folders["target"], "--prompts", str(text), "--per-category", "1",
                             "--out-dir", str(tmp_path / "b")], "--per-category needs a JSONL prompt file")


def test_demo_past_the_context_is_one_line(capsys):
    assert one_line_exit_2(capsys, ["demo", "--offline", "--max-new-tokens", "5000"], "exceed the target's context")


@pytest.mark.parametrize("lines,message", [
    ([["not", "a", "header"]], "expected a JSON object, got list"),
    ([{"trace": "specbatch", "version": 2, "layout": "diagonal"}], "field 'layout' must be 'rectangular' or"),
    ("results-without-tokens", "results line, entry 0: field 'tokens' is missing"),
    ("row-without-mask", "row 0: field 'mask' is missing"),
    ("request-out-of-range", "field 'request' is 7, not a request"),
])
def test_check_trace_validates_the_schema_first(folders, prompt_file, tmp_path, capsys, lines, message):
    trace = tmp_path / "t.jsonl"
    if isinstance(lines, str):
        good = tmp_path / "good.jsonl"
        assert main(gen_args(folders, prompt_file, "--trace", str(good), "--jsonl-stdout")) == 0
        objs = [json.loads(x) for x in good.read_text().splitlines()]
        if lines == "results-without-tokens":
            del objs[-1]["results"][0]["tokens"]
        elif lines == "row-without-mask":
            del objs[1]["rows"][0]["mask"]
        else:
            objs[1]["rows"][0]["request"] = 7
        lines = objs
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    capsys.readouterr()
    assert one_line_exit_2(capsys, ["check-trace", str(trace)], message)


@pytest.mark.full  # CLI subprocesses
def test_user_errors_show_a_traceback_only_with_debug(folders, tmp_path):
    code, err = run_cli("generate", "--target", folders["target"], "--prompts", str(tmp_path / "none.jsonl"))
    assert code == 2 and len(err) == 1
    code, err = run_cli("--debug", "generate", "--target", folders["target"], "--prompts", str(tmp_path / "none.jsonl"))
    assert code == 1 and any("Traceback" in line for line in err)


def test_float_checks_agree_with_math():
    from specbatch.options import check_real
    for bad in (math.nan, math.inf, -math.inf, True, "1"):
        with pytest.raises(OptionError):
            check_real("x", bad, 0.0)
    assert check_real("x", 0, 0.0) == 0.0


def test_every_exception_specbatch_raises_on_purpose_is_a_specbatch_error():
    """One base to catch: each error class of the package derives from specbatch.SpecbatchError
    (and keeps the built-in base callers may already catch)."""
    import specbatch
    from specbatch.conformance.greedy import VectorError
    from specbatch.errors import UserError
    from specbatch.fast.loading import ModelLoadError
    from specbatch.invariants.trace import TraceError
    from specbatch.invariants.violations import InvariantError
    from specbatch.io import InputError, OutputError
    from specbatch.options import OptionError
    from specbatch.conformance.serving import ServerError
    from specbatch.tensor_parallel import TensorParallelError
    from specbatch.conformance.testing import ConformanceError
    classes = [UserError, VectorError, ModelLoadError, TraceError, InvariantError, InputError, OutputError,
               OptionError, ServerError, TensorParallelError, ConformanceError]
    assert all(issubclass(c, specbatch.SpecbatchError) for c in classes)
    assert issubclass(OptionError, ValueError) and issubclass(ConformanceError, AssertionError)
    with pytest.raises(specbatch.SpecbatchError, match="temperature"):
        specbatch.generate(None, None, [[1]], temperature=-1.0)
