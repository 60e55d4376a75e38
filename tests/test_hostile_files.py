"""Hostile files, second round: nothing written through a symlink or over what specbatch does not
own, --resume refusing runs made otherwise, one strict reader for every JSON input, vectors that
cannot be altered unnoticed, a FIFO never waited on, a corrupted model cache in one line, an output
locked against a second run, and a Python checker as strict as the CLI's."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hf_models import tiny
from specbatch.cli.commands import main
from specbatch.io import InputError, OutputError, ResultWriter, loads_strict, open_for_writing


def gen_args(folders, prompts, *extra):
    return ["generate", "--target", folders["target"], "--draft", folders["draft"], "--prompts", str(prompts),
            "--dtype", "float64", "--max-new-tokens", "6", "--batch-size", "3",
            "--policy", "threshold", *extra]  # the goodput policy's per-request rounds follow the clock


def exit_2_with(capsys, argv, message, warnings_ok=False):
    """The CLI exits with 2 and prints exactly one error line on stderr, which names the problem
    (warning lines before it allowed with warnings_ok)."""
    code = main(argv)
    err = [x for x in capsys.readouterr().err.strip().splitlines() if "req/s" not in x and "s/req" not in x and x.strip()
           and not (warnings_ok and x.startswith("warning: "))]
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert message in err[0], err[0]


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture()
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text("keep me\n")
    return path


@pytest.fixture()
def finished(folders, prompt_file, tmp_path):
    """A whole run's results file (and its settings record) to resume from."""
    whole = tmp_path / "whole.jsonl"
    assert main(gen_args(folders, prompt_file, "--out", str(whole))) == 0
    return whole


def interrupted(whole, out, keep=2):
    """`out` as a run with `whole`'s settings leaves it when killed after `keep` results."""
    out.write_text("".join(whole.read_text().splitlines(keepends=True)[:keep]))
    shutil.copy(f"{whole}.settings.json", f"{out}.settings.json")
    return digest(out)


# ---------------------------------------------------------------- 1. files we do not own

def test_a_symlinked_or_foreign_temporary_is_never_written(folders, prompt_file, finished, tmp_path, victim):
    out = tmp_path / "o.jsonl"
    (tmp_path / "o.jsonl.tmp").symlink_to(victim)  # where a fixed temporary name would have gone
    (tmp_path / ".o.jsonl.tmp").mkdir()
    before = digest(victim)
    assert main(gen_args(folders, prompt_file, "--out", str(out))) == 0
    assert digest(victim) == before and not out.is_symlink() and out.read_bytes() == finished.read_bytes()
    interrupted(finished, out)
    assert main(gen_args(folders, prompt_file, "--out", str(out), "--resume")) == 0  # the in-order rewrite
    assert digest(victim) == before and not out.is_symlink() and out.read_bytes() == finished.read_bytes()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".o.jsonl.") and p.name != ".o.jsonl.tmp"]
    assert leftovers == []  # no temporary left behind


@pytest.mark.parametrize("writer", ["part", "trace", "result"])
def test_every_writer_refuses_a_symlink_and_leaves_its_target_alone(tmp_path, victim, writer):
    link = tmp_path / "link"
    link.symlink_to(victim)
    before = digest(victim)
    with pytest.raises(OutputError, match="symlink"):
        if writer == "part":
            ResultWriter(link, ["a"], {}, append=True)
        elif writer == "result":
            ResultWriter(link, ["a"], {})
        else:
            from specbatch.invariants import TraceWriter
            TraceWriter(link, layout="ragged", strategy="ragged", eos_token_ids=[1], max_new_tokens=4, num_requests=1)
    assert digest(victim) == before and link.is_symlink()


def test_open_for_writing_refuses_a_fifo_and_a_folder_without_waiting(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="FIFO"):
        open_for_writing(fifo)
    (tmp_path / "dir").mkdir()
    with pytest.raises(OutputError, match="directory"):
        open_for_writing(tmp_path / "dir")


def test_part_files_of_another_run_are_kept_and_never_followed(folders, prompt_file, finished, tmp_path, victim,
                                                               capsys):
    out = tmp_path / "o.jsonl"
    part = tmp_path / "o.jsonl.part1"
    part.symlink_to(victim)
    before = digest(victim)
    exit_2_with(capsys, gen_args(folders, prompt_file, "--out", str(out)), "o.jsonl.part1 holds results of an "
                "interrupted run")
    exit_2_with(capsys, gen_args(folders, prompt_file, "--out", str(out), "--resume"), "is a symlink")
    assert digest(victim) == before and part.is_symlink() and not out.exists()
    part.unlink()
    part.mkdir()
    exit_2_with(capsys, gen_args(folders, prompt_file, "--out", str(out), "--resume"), "is a directory")


def test_a_resumed_run_keeps_every_part_result_until_the_merged_file_holds_it(folders, prompt_file, finished,
                                                                              tmp_path):
    """Results of an interrupted torchrun run live in part files; a resume (here in one process)
    takes them over and removes the parts only once the merged file holds them."""
    out = tmp_path / "o.jsonl"
    lines = finished.read_text().splitlines(keepends=True)
    (tmp_path / "o.jsonl.part0").write_text(lines[0] + lines[3])
    (tmp_path / "o.jsonl.part1").write_text(lines[1] + lines[4][:9])  # a torn last line
    shutil.copy(f"{finished}.settings.json", f"{out}.settings.json")
    assert main(gen_args(folders, prompt_file, "--out", str(out), "--resume")) == 0
    assert out.read_bytes() == finished.read_bytes() and not list(tmp_path.glob("o.jsonl.part*"))


def test_an_appended_part_file_is_never_truncated(tmp_path):
    part = tmp_path / "o.jsonl.part0"
    part.write_text('{"id": "a", "token_ids": [1]}\n{"id": "b", "tok')
    writer = ResultWriter(part, ["a", "b", "c"], {}, append=True)
    writer.add({"id": "c", "token_ids": [3]})
    writer.file.close()
    assert part.read_text() == '{"id": "a", "token_ids": [1]}\n{"id": "c", "token_ids": [3]}\n'


# ---------------------------------------------------------------- 2. resume never mixes runs

@pytest.mark.parametrize("changed,named", [
    (["--max-new-tokens", "4"], "max_new_tokens was 6, now 4"),
    (["--temperature", "1", "--seed", "1"], "temperature was 0.0, now 1.0"),
    (["--seed", "5"], "seed was 0, now 5"),
    (["--draft", "lookup"], "draft was"),
    (["--target", "OTHER"], "target was"),
    (["--dtype", "float32"], "dtype was 'float64', now 'float32'"),
    (["--strategy", "eqspec"], "strategy was 'ragged', now 'eqspec'"),
    (["--chat-template"], "chat_template"),
])
def test_resume_refuses_a_run_made_with_other_settings(folders, prompt_file, finished, tmp_path, capsys, changed,
                                                       named):
    out = tmp_path / "o.jsonl"
    before = interrupted(finished, out)
    argv = gen_args(folders, prompt_file, "--out", str(out), "--resume")
    if changed[0] == "--target":
        other = tmp_path / "other_target"
        shutil.copytree(folders["target"], other)
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float64)
        with torch.no_grad():
            next(model.parameters()).mul_(1.5)
        model.save_pretrained(other)
        changed = ["--target", str(other)]
    code = main(argv + changed)
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x.strip()]
    if changed == ["--chat-template"]:  # the tiny tokenizer has no template: refused before anything else
        assert code == 2
    else:
        assert code == 2 and len(err) == 1 and named in err[0] and "start afresh" in err[0], err
    assert digest(out) == before


def test_resume_with_the_same_settings_and_another_batch_size_completes_the_file(folders, prompt_file, finished,
                                                                                 tmp_path):
    out = tmp_path / "o.jsonl"
    interrupted(finished, out)
    assert main(gen_args(folders, prompt_file, "--out", str(out), "--resume") + ["--batch-size", "1"]) == 0
    assert out.read_bytes() == finished.read_bytes()


@pytest.mark.parametrize("edit,named", [
    (lambda r: r.update(token_ids=[-5] + r["token_ids"][1:]), "outside the vocabulary"),
    (lambda r: r.update(token_ids=r["token_ids"][:-1] + [100000]), "outside the vocabulary"),
    (lambda r: r.update(token_ids=r["token_ids"] + [3] * 9), "does not fit this run"),
    (lambda r: r.update(stop_reason="eos", token_ids=r["token_ids"][:-1] + [8]), "does not fit this run"),
])
def test_resume_checks_every_kept_result(folders, prompt_file, finished, tmp_path, capsys, edit, named):
    out = tmp_path / "o.jsonl"
    interrupted(finished, out)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    edit(rows[0])
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = digest(out)
    exit_2_with(capsys, gen_args(folders, prompt_file, "--out", str(out), "--resume"), named)
    assert digest(out) == before


def test_resume_without_a_settings_record_is_refused(folders, prompt_file, finished, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    interrupted(finished, out)
    os.remove(f"{out}.settings.json")
    before = digest(out)
    exit_2_with(capsys, gen_args(folders, prompt_file, "--out", str(out), "--resume"), "has no o.jsonl.settings.json")
    assert digest(out) == before and not os.path.exists(f"{out}.settings.json")  # nothing written, nothing made up


# ---------------------------------------------------------------- 3. one strict reader

MALFORMED = {
    "deep nesting": "[" * 100000 + "]" * 100000,
    "a 5,000-digit integer": '{"id": ' + "7" * 5000 + "}",
    "a lone surrogate": '{"id": "\\ud800", "prompt": "x"}',
    "NaN": '{"id": NaN, "prompt": "x"}',
    "Infinity": '{"id": "q", "x": -Infinity}',
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_the_strict_reader_names_the_file_and_line(kind):
    with pytest.raises(InputError, match="^f.jsonl:3: "):
        loads_strict(MALFORMED[kind], "f.jsonl:3")


@pytest.mark.parametrize("reader", ["prompts", "results", "outputs", "trace", "compare"])
@pytest.mark.parametrize("kind", list(MALFORMED))
def test_every_reader_answers_malformed_json_in_one_line(folders, prompt_file, vectors_folder, tmp_path, capsys,
                                                         reader, kind):
    bad = tmp_path / "bad.jsonl"
    good_line = '{"id": "q0", "prompt": "w1"}' if reader == "prompts" else '{"id": "q0", "token_ids": [1]}'
    if reader == "trace":
        good_line = '{"trace": "specbatch", "version": 2, "layout": "ragged"}'
    if reader == "compare":
        good_line = '{"seconds": 1.0}'
    bad.write_text(good_line + "\n" + MALFORMED[kind] + "\n" + good_line + "\n")
    argv = {"prompts": gen_args(folders, bad),
            "results": gen_args(folders, prompt_file, "--out", str(bad), "--resume"),
            "outputs": ["conform", "check", str(vectors_folder), str(bad)],
            "trace": ["check-trace", str(bad)],
            "compare": ["bench", "--target", folders["target"], "--prompts", str(prompt_file), "--compare", str(bad)],
            }[reader]
    exit_2_with(capsys, argv, "bad.jsonl:2: ")


# ---------------------------------------------------------------- 4. vectors cannot be altered unnoticed

@pytest.fixture(scope="module")
def vectors_folder(tmp_path_factory):
    from specbatch.conformance.greedy import make_vectors
    folder = tmp_path_factory.mktemp("vectors") / "v"
    make_vectors(tiny("llama"), folder)
    return folder


def reference_outputs_file(folder, path, drop=()):
    rows = [json.loads(x) for x in open(folder / "reference.jsonl")]
    path.write_text("".join(json.dumps(dict(id=r["id"], token_ids=r["token_ids"])) + "\n" for r in rows
                            if r["id"] not in drop))
    return path


def test_shortened_vectors_are_refused(vectors_folder, tmp_path, capsys):
    folder = tmp_path / "v"
    shutil.copytree(vectors_folder, folder)
    requests = folder.joinpath("requests.jsonl").read_text().splitlines(keepends=True)
    dropped = [json.loads(x)["id"] for x in requests[:2]]
    folder.joinpath("requests.jsonl").write_text("".join(requests[2:]))
    outputs = reference_outputs_file(vectors_folder, tmp_path / "out.jsonl", drop=dropped)
    exit_2_with(capsys, ["conform", "check", str(folder), str(outputs)], "requests.jsonl differs from the vectors")
    assert main(["conform", "check", str(vectors_folder), str(reference_outputs_file(vectors_folder,
                                                                                  tmp_path / "all.jsonl"))]) == 0


@pytest.mark.parametrize("tamper,named", [
    (lambda m, req, ref: m.pop("dtype"), "field 'dtype'"),
    (lambda m, req, ref: m.update(dtype="int64"), "field 'dtype'"),
    (lambda m, req, ref: req[0].pop("class"), "field 'class'"),
    (lambda m, req, ref: req[0].pop("token_ids"), "field 'token_ids'"),
    (lambda m, req, ref: ref[0].pop("top"), "field 'top'"),
    (lambda m, req, ref: ref[0]["top"][0][0].__setitem__(1, float("nan")), "NaN"),
    (lambda m, req, ref: ref[0]["top"][0][0].__setitem__(1, float("inf")), "Infinity"),
])
def test_tampered_vectors_are_one_line_even_with_allow_modified(vectors_folder, tmp_path, capsys, tamper, named):
    folder = tmp_path / "v"
    shutil.copytree(vectors_folder, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    req = [json.loads(x) for x in open(folder / "requests.jsonl")]
    ref = [json.loads(x) for x in open(folder / "reference.jsonl")]
    tamper(manifest, req, ref)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in req))
    (folder / "reference.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ref))
    outputs = reference_outputs_file(vectors_folder, tmp_path / "out.jsonl")
    exit_2_with(capsys, ["conform", "check", "--allow-modified", str(folder), str(outputs)], named, warnings_ok=True)


def test_allow_modified_checks_altered_vectors_with_a_warning(vectors_folder, tmp_path, capsys):
    folder = tmp_path / "v"
    shutil.copytree(vectors_folder, folder)
    with open(folder / "requests.jsonl", "a") as f:
        f.write("\n")  # a harmless change the checksum still sees
    outputs = reference_outputs_file(vectors_folder, tmp_path / "out.jsonl")
    assert main(["conform", "check", "--allow-modified", str(folder), str(outputs)]) == 0
    assert "warning: " in capsys.readouterr().err


def test_a_vectors_path_that_is_a_file_and_a_too_short_context_are_one_line(vectors_folder, tmp_path, capsys):
    outputs = reference_outputs_file(vectors_folder, tmp_path / "out.jsonl")
    exit_2_with(capsys, ["conform", "check", str(outputs), str(outputs)], "not a folder of conformance vectors")
    from specbatch.conformance.greedy import VectorError, make_vectors
    with pytest.raises(VectorError, match="too short for conformance vectors"):
        make_vectors(tiny("llama", max_position_embeddings=48), tmp_path / "short")


# ---------------------------------------------------------------- 5. FIFOs, and the model cache

@pytest.mark.full  # each refusal waits out a subprocess
def test_a_fifo_as_input_is_refused_not_waited_on(folders, vectors_folder, tmp_path):
    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    for argv in (["conform", "check", str(vectors_folder), str(fifo)], ["check-trace", str(fifo)],
                 gen_args(folders, fifo)):
        done = subprocess.run([sys.executable, "-m", "specbatch", *argv], capture_output=True, text=True, timeout=120)
        err = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(err) == 1 and "not a regular file" in err[0], (argv, err)


def test_a_corrupted_model_cache_is_one_line_naming_the_folder(tmp_path, monkeypatch, capsys):
    from specbatch.errors import UserError
    from specbatch.prepare import load
    as_file = tmp_path / "cache-file"
    as_file.write_text("not a folder")
    monkeypatch.setenv("SPECBATCH_CACHE", str(as_file))
    with pytest.raises(UserError, match="is not a folder"):
        load("smollm2")
    cache = tmp_path / "cache"
    converted = cache / "smollm2" / "converted"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text('{"model_type": "llama", "vocab_size": 10')  # truncated
    monkeypatch.setenv("SPECBATCH_CACHE", str(cache))
    with pytest.raises(UserError, match=f"cached SmolLM2 in {converted} cannot be loaded.*delete that folder"):
        load("smollm2")
    (converted / "config.json").write_text(json.dumps(tiny("llama").config.to_dict()))
    (converted / "model.safetensors").write_bytes(b"\x00" * 12)  # truncated weights
    with pytest.raises(UserError, match="cannot be loaded"):
        load("smollm2")


# ---------------------------------------------------------------- 6. one run per output

def test_a_second_run_on_a_held_output_is_refused_and_the_first_file_stays(folders, prompt_file, finished, tmp_path,
                                                                            capsys):
    out = tmp_path / "o.jsonl"
    shutil.copy(finished, out)
    before = digest(out)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from specbatch.io import OutputLock; "
                               "lock = OutputLock(sys.argv[1]); print('held', flush=True); time.sleep(120)", str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        exit_2_with(capsys, gen_args(folders, prompt_file, "--out", str(out)), "is in use by another specbatch run")
        assert digest(out) == before
    finally:
        holder.send_signal(signal.SIGKILL)  # the OS releases the lock of a killed run
        holder.wait()
    assert main(gen_args(folders, prompt_file, "--out", str(out), "--overwrite")) == 0  # it holds results


# ---------------------------------------------------------------- 7. the Python checker

@pytest.mark.parametrize("corrupt,named", [
    (lambda t: [x + 0.7 for x in t], "float"),
    (lambda t: [str(x) for x in t], "str"),
    (lambda t: [True] + t[1:], "bool"),
    (lambda t: None, "NoneType"),
])
def test_check_engine_refuses_outputs_that_are_not_integer_ids(vectors_folder, corrupt, named):
    from specbatch.conformance.greedy import load_vectors
    from specbatch.conformance.testing import ConformanceError, check_engine
    vectors = load_vectors(vectors_folder)
    answers = {tuple(r["token_ids"]): vectors.reference[r["id"]]["token_ids"] for r in vectors.requests}

    def engine(prompts, max_new_tokens, eos_token_ids, batch_size):
        out = [list(answers[tuple(p)]) for p in prompts]
        out[0] = corrupt(out[0]) if out[0] else corrupt([1])
        return out
    with pytest.raises(ConformanceError, match=named):
        check_engine(engine, vectors, batch_sizes=(1,), orders=("input",))

    def numpy_engine(prompts, max_new_tokens, eos_token_ids, batch_size):
        return [np.array(answers[tuple(p)], dtype=np.int64) for p in prompts]
    check_engine(numpy_engine, vectors, batch_sizes=(1,), orders=("input",))  # NumPy integers are ids


@pytest.mark.full  # waits out its timeout
def test_check_engine_takes_a_model_and_a_timeout():
    from specbatch.conformance.testing import ConformanceError, check_engine, specbatch_engine
    target = tiny("llama")
    check_engine(specbatch_engine(target, None), target, batch_sizes=(4,), orders=("input",))

    def hangs(prompts, max_new_tokens, eos_token_ids, batch_size):
        time.sleep(30)
    with pytest.raises(ConformanceError, match="did not return within 0.5 s"):
        check_engine(hangs, target, batch_sizes=(4,), orders=("input",), timeout=0.5)
    with pytest.raises(ConformanceError, match="vectors must be"):
        check_engine(hangs, 42)


@pytest.mark.parametrize("field,value", [("tie_ulps_default", 1e30), ("dtype", "bfloat16"), ("eos_token_ids", []),
                                         ("pad_token_id", 0), ("classes", ["churn"])])
def test_an_edited_manifest_is_refused_like_altered_vectors(vectors_folder, tmp_path, capsys, field, value):
    """Every manifest field that decides a verdict is covered by its digest: editing one (a looser
    tie tolerance, another dtype, no EOS ids, ...) is refused in one line, as altered files are."""
    folder = tmp_path / "v"
    shutil.copytree(vectors_folder, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest[field] = value
    (folder / "manifest.json").write_text(json.dumps(manifest))
    outputs = reference_outputs_file(vectors_folder, tmp_path / "out.jsonl")
    exit_2_with(capsys, ["conform", "check", str(folder), str(outputs)], "the fields that decide verdicts")
    if field == "tie_ulps_default":  # even when told to check anyway, a tolerance past the cap is refused
        exit_2_with(capsys, ["conform", "check", "--allow-modified", str(folder), str(outputs)], "cap",
                    warnings_ok=True)


def test_an_edited_sampled_manifest_is_refused(tmp_path):
    from specbatch.conformance.greedy import VectorError
    from specbatch.conformance.sampled import load_sampled_vectors, make_sampled_vectors
    from specbatch.conformance.testing import toy_sampling_pair
    make_sampled_vectors(toy_sampling_pair()[0], tmp_path / "s", samples=4)
    load_sampled_vectors(tmp_path / "s")
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    manifest["alpha"] = 0.5
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(VectorError, match="the fields that decide verdicts"):
        load_sampled_vectors(tmp_path / "s")
    warned = []
    assert load_sampled_vectors(tmp_path / "s", allow_modified=True, warn=warned.append).manifest["alpha"] == 0.5
    assert warned and "--allow-modified" in warned[0]


def test_sampled_processor_vectors_load_as_they_were_made(tmp_path):
    """A logit bias's token ids are integer keys when the digest is made and strings on disk: ids
    whose numeric and text orders differ (9 < 10, "10" < "9") must give the same digest."""
    from specbatch.conformance.sampled import load_sampled_vectors, make_sampled_vectors
    from specbatch.conformance.testing import toy_sampling_pair
    bias = dict(name="t1.0-bias", temperature=1.0, top_k=None, top_p=None, logit_bias={9: 1.5, 10: -2.0})
    manifest = make_sampled_vectors(toy_sampling_pair()[0], tmp_path / "s", samples=4, settings=[bias])
    loaded = load_sampled_vectors(tmp_path / "s")
    assert loaded.manifest["manifest_sha256"] == manifest["manifest_sha256"]
    assert loaded.settings()[0]["logit_bias"] == {"9": 1.5, "10": -2.0}


def test_a_converted_model_changed_in_place_is_never_decoded(tmp_path, monkeypatch):
    """The converted SmolLM2 cache carries the SHA-256 of its files from the conversion: weights
    altered in place (still loadable) are refused in one line naming the folder."""
    import torch

    from hf_models import save_folder
    from specbatch.errors import UserError
    from specbatch.fast.loading import write_digest
    from specbatch.prepare import load
    converted = tmp_path / "cache" / "smollm2" / "converted"
    save_folder(converted, tiny("llama", dtype=torch.float32))
    write_digest(converted)
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    assert load("smollm2")[0] is not None  # as converted: loads
    weights = bytearray((converted / "model.safetensors").read_bytes())
    weights[-4] ^= 0x01  # one bit of the last weight: the file still loads
    (converted / "model.safetensors").write_bytes(bytes(weights))
    with pytest.raises(UserError, match=f"{converted} cannot be loaded \\(model.safetensors changed since it was "
                                        "converted"):
        load("smollm2")
