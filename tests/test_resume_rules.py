"""Each rule of `--resume` and each documented one-line refusal, at the edge a one-line bug would
move: a kept result cut short, settings compared both ways, only a torn last line forgiven, unique
ids, nothing truncated by the resumed writer; tensor parallelism's KV heads and the arrivals' order."""
import json

import pytest

from specbatch.io import InputError, ResultWriter, read_done
from specbatch.options import OptionError, check_arrivals
from specbatch.cli.resume import RECORD_FORMAT, check_kept, check_same_run, write_record


def lines(*records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_a_kept_result_must_have_its_full_length_or_end_in_eos():
    full = dict(token_ids=[5, 6, 7], stop_reason="length")
    stopped = dict(token_ids=[5, 2], stop_reason="eos")
    check_kept({"a": full, "b": stopped}, vocab=10, eos_ids=[2], budget=3, where="out")
    with pytest.raises(InputError, match="'c' .*2 tokens, stop_reason 'length'"):
        check_kept({"c": dict(token_ids=[5, 6], stop_reason="length")}, vocab=10, eos_ids=[2], budget=3, where="out")
    with pytest.raises(InputError, match="'d'"):  # an "eos" stop that does not end in an EOS id
        check_kept({"d": dict(token_ids=[5, 6], stop_reason="eos")}, vocab=10, eos_ids=[2], budget=3, where="out")


def test_settings_are_compared_both_ways(tmp_path):
    out = tmp_path / "r.jsonl"
    old = dict(format=RECORD_FORMAT, target="t", options=dict(seed=0))
    write_record(out, old)
    check_same_run(out, dict(old))
    with pytest.raises(InputError, match="tensor_parallel was None, now 2"):  # a setting new in this run
        check_same_run(out, dict(old, tensor_parallel=2))
    write_record(out, dict(old, tensor_parallel=2))
    with pytest.raises(InputError, match="tensor_parallel was 2, now None"):  # one the old run had
        check_same_run(out, dict(old))
    write_record(out, old)
    with pytest.raises(InputError, match="options.seed was 0, now 1"):
        check_same_run(out, dict(old, options=dict(seed=1)))


def test_only_a_torn_last_line_is_forgiven(tmp_path):
    path = tmp_path / "r.jsonl"
    a, b = dict(id="a", token_ids=[1]), dict(id="b", token_ids=[2])
    path.write_text(lines(a, b) + '{"id": "c", "tok')  # a write killed midway
    assert set(read_done(path)) == {"a", "b"}
    path.write_text(lines(a) + '{"id": "x", "tok\n' + lines(b))  # the same damage in the middle
    before = path.read_bytes()
    with pytest.raises(InputError, match=":2: .*fix or remove the line"):
        read_done(path)
    assert path.read_bytes() == before


def test_ids_are_unique_and_known(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(lines(dict(id="a", token_ids=[1]), dict(id="a", token_ids=[3])))
    with pytest.raises(InputError, match="'a' appears twice"):
        read_done(path)
    path.write_text(lines(dict(id="z", token_ids=[1])))
    with pytest.raises(InputError, match="'z' is not in the prompt file"):
        read_done(path, known_ids=["a", "b"])


def test_the_resumed_writer_keeps_what_was_there(tmp_path):
    path = tmp_path / "r.jsonl"
    kept = {"a": dict(id="a", token_ids=[1]), "c": dict(id="c", token_ids=[3])}
    path.write_text(lines(*kept.values()) + '{"id": "b", "to')
    writer = ResultWriter(path, ["a", "b", "c"], read_done(path))
    writer.add(dict(id="b", token_ids=[2]))
    on_disk = {r["id"] for r in map(json.loads, path.read_text().splitlines())}
    assert on_disk == {"a", "b", "c"}  # before finish: a crash now loses nothing that was kept
    writer.finish()
    assert path.read_text() == lines(kept["a"], dict(id="b", token_ids=[2]), kept["c"])  # input order, all kept


def test_arrivals_must_not_go_back_in_time_from_the_first_pair_on():
    assert check_arrivals([0.0, 0.5, 0.5, 2.0], 4) == [0.0, 0.5, 0.5, 2.0]
    with pytest.raises(OptionError, match=r"arrivals\[1\] = 0.5 < arrivals\[0\] = 1.0"):
        check_arrivals([1.0, 0.5, 2.0], 3)
    with pytest.raises(OptionError, match=r"arrivals\[2\]"):
        check_arrivals([0.0, 1.0, 0.5], 3)


def test_tensor_parallelism_refuses_kv_heads_that_do_not_divide():
    from hf_models import tiny
    from specbatch.tensor_parallel import TensorParallelError, check_shardable
    gqa = tiny("llama", num_attention_heads=4, num_key_value_heads=1)  # 4 query heads divide by 2, 1 KV head not
    with pytest.raises(TensorParallelError, match="1 key value heads do not divide among 2 ranks"):
        check_shardable(gqa, 2)
    check_shardable(tiny("llama", num_attention_heads=4, num_key_value_heads=2), 2)
