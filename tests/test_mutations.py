"""Mutation tests: the known broken variants of published implementations, built on the reference
engine, must each be rejected by the checkers with the right invariant id, live (check_invariants=True) and,
where the trace shows it, by check_trace / `specbatch check-trace`."""
import numpy as np
import pytest

import specbatch.reference.engine as engine
from reference_cases import TARGET, VOCAB
from specbatch.cli.commands import main
from specbatch.invariants import InvariantError, check_trace
from specbatch.reference import RectState, ScriptedDraft, deviate_hashed, generate

PAD = EOS = 3
PROMPTS = [[5, PAD, 7, 1], [2], [9, 9, PAD, PAD, 4, 6, 8], [PAD, 1, 2]]  # pad id inside content, pad == eos
DRAFT = ScriptedDraft(TARGET, deviate_hashed(5, 0.3))


def mask_from_pad_id(monkeypatch):
    original = RectState.slot_index

    def slot_index(self, columns=None):  # "attention_mask = tokens != pad_id"
        index = original(self, columns)
        width = min(index.shape[1], self.width)
        index[:, :width][self.tokens[:, :width] == PAD] = -1
        return index
    monkeypatch.setattr(RectState, "slot_index", slot_index)


def rejected_drafts_kept_in_cache(monkeypatch):
    monkeypatch.setattr(engine, "unstack_kv", lambda past, row, start, count: [
        (k[row, start:].copy(), v[row, start:].copy()) for k, v in past])


def repad_without_unpad(monkeypatch):
    """Rounds (not the prefill) lay rows out left-aligned with pads on the right."""
    class RightPadded(RectState):
        @property
        def pad_len(self):  # content stays at the left; the repad adds pads on the right
            return np.zeros(len(self.content_len), dtype=np.int64)

    def from_rows(rows, pad_id=0):
        width = max(len(r) for r in rows)
        tokens = np.array([list(r) + [pad_id] * (width - len(r)) for r in rows])
        return RightPadded(tokens, np.array([len(r) for r in rows]))

    original_round = engine.rect_round

    def rect_round(*args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(RectState, "from_rows", staticmethod(from_rows))
            return original_round(*args, **kwargs)
    monkeypatch.setattr(engine, "rect_round", rect_round)


def no_bonus_token(monkeypatch):
    original = engine.commit_counts

    def commit_counts(choice, accepted, remaining, eos_ids):
        n, eos = original(choice, accepted, remaining, eos_ids)
        full = accepted == choice.shape[1] - 1
        return np.where(full & (n > accepted), accepted, n), eos
    monkeypatch.setattr(engine, "commit_counts", commit_counts)


def bonus_from_draft(monkeypatch):
    def committed_tokens(choice, drafted, n):
        out = [choice[i, :n[i]].tolist() for i in range(choice.shape[0])]
        for i, tokens in enumerate(out):
            if drafted.shape[1] and n[i] == drafted.shape[1] + 1:
                tokens[-1] = (int(drafted[i, -1]) + 1) % VOCAB  # not the target's choice
        return out
    monkeypatch.setattr(engine, "committed_tokens", committed_tokens)


def tokens_after_eos(monkeypatch):
    original = engine.commit_counts
    monkeypatch.setattr(engine, "commit_counts",
                        lambda choice, accepted, remaining, eos_ids: original(choice, accepted, remaining, ()))


MUTANTS = [  # (mutant, draft, invariant the live checkers report, invariant check_trace reports or None)
    (mask_from_pad_id, DRAFT, "I4", "I4"),
    (rejected_drafts_kept_in_cache, DRAFT, "I3", None),
    (repad_without_unpad, DRAFT, "I1", None),  # it cannot even run a round: the trace stays empty
    (no_bonus_token, TARGET, "I5", "I5"),
    (bonus_from_draft, TARGET, "I5", "I5"),
    (tokens_after_eos, DRAFT, "I6", "I6"),
]


def run(draft, **kw):
    eos = _eos_hit_by_target()
    return generate(TARGET, draft, PROMPTS, max_new_tokens=16, num_draft_tokens=3, eos_token_id=(PAD, eos),
                    pad_token_id=PAD, strategy="eqspec", batch_size=4, **kw)


def _eos_hit_by_target():
    """An EOS id the target really produces mid-way, so the stop rule is exercised."""
    from specbatch.reference import greedy_decode
    return greedy_decode(TARGET, PROMPTS[0], 6)[4]


def test_the_correct_engine_passes_every_check(tmp_path):
    run(DRAFT, check_invariants=True, trace=tmp_path / "ok.jsonl")
    assert check_trace(tmp_path / "ok.jsonl") == []
    assert main(["check-trace", str(tmp_path / "ok.jsonl")]) == 0


@pytest.mark.parametrize("mutant,draft,live_id,trace_id", MUTANTS, ids=[m[0].__name__ for m in MUTANTS])
def test_live_checkers_reject_the_broken_variant(monkeypatch, mutant, draft, live_id, trace_id):
    mutant(monkeypatch)
    with pytest.raises(InvariantError) as caught:
        run(draft, check_invariants=True)
    assert caught.value.invariant == live_id, str(caught.value)


@pytest.mark.parametrize("mutant,draft,live_id,trace_id", [m for m in MUTANTS if m[3]],
                         ids=[m[0].__name__ for m in MUTANTS if m[3]])
def test_check_trace_rejects_the_broken_variant(monkeypatch, tmp_path, capsys, mutant, draft, live_id, trace_id):
    mutant(monkeypatch)
    path = tmp_path / "bad.jsonl"
    run(draft, trace=path)
    violations = check_trace(path)
    assert violations and violations[0].invariant == trace_id, violations[:1]
    assert main(["check-trace", str(path)]) == 1
    assert trace_id in capsys.readouterr().out


CORRUPTIONS = {  # corrupt one field of the first multi-token round of a correct trace
    "I1": lambda row: row.update(pad_len=row["pad_len"] + 1),
    "I2": lambda row: row.update(positions=[p + 1 for p in row["positions"]]),
    "I4": lambda row: row.update(mask=[m[:-1] + "0" for m in row["mask"]]),
    "I5": lambda row: row.update(committed=[(row["committed"][0] + 1) % VOCAB] + row["committed"][1:]),
}


@pytest.mark.parametrize("invariant", sorted(CORRUPTIONS))
def test_check_trace_rejects_a_corrupted_trace(tmp_path, invariant):
    import json
    run(DRAFT, trace=tmp_path / "ok.jsonl")
    lines = [json.loads(line) for line in open(tmp_path / "ok.jsonl")]
    CORRUPTIONS[invariant](lines[1]["rows"][2])
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    found = check_trace(tmp_path / "bad.jsonl")
    assert found and found[0].invariant == invariant and found[0].round == 1, found[:1]


def test_check_trace_rejects_results_out_of_order_and_tokens_after_eos(tmp_path):
    import json
    run(DRAFT, trace=tmp_path / "ok.jsonl")
    lines = [json.loads(line) for line in open(tmp_path / "ok.jsonl")]
    results = lines[-1]["results"]
    results[0], results[1] = results[1], results[0]
    (tmp_path / "order.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert [v.invariant for v in check_trace(tmp_path / "order.jsonl")][:1] == ["S2"]
    results[0], results[1] = results[1], results[0]
    eos_row = next(r for r in results if r["stop_reason"] == "eos")
    eos_row["tokens"].append(1)
    (tmp_path / "eos.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert "I6" in [v.invariant for v in check_trace(tmp_path / "eos.jsonl")]


def test_check_trace_unreadable_file_exits_2_with_one_line(tmp_path, capsys):
    assert main(["check-trace", str(tmp_path / "missing.jsonl")]) == 2
    (tmp_path / "junk.jsonl").write_text("{not json\n")
    assert main(["check-trace", str(tmp_path / "junk.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("error" in line for line in err)


def test_every_mutant_of_the_harness_applies_to_the_code_as_it_is():
    """tests/mutation/mutants.py names each mutant by a text that must occur exactly once in its file;
    a refactor that moves the text makes the mutant stale (the harness would report it, not run it)."""
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests" / "mutation"))
    try:
        from mutants import MUTANTS
    finally:
        sys.path.pop(0)
    stale = [(ident, file, (root / file).read_text().count(old)) for ident, _, file, old, _, _ in MUTANTS
             if (root / file).read_text().count(old) != 1]
    assert not stale, stale
    assert len({m[0] for m in MUTANTS}) == len(MUTANTS)  # ids are unique


@pytest.mark.parametrize("script,verdict", [("import sys; sys.exit(1)", "error"),
                                            ("print('FAILED tests/test_x.py::test_y - boom'); raise SystemExit(1)",
                                             "killed"),
                                            ("pass", "SURVIVED")])
def test_the_harness_counts_a_kill_only_when_a_test_fails(tmp_path, monkeypatch, script, verdict):
    """Exit code 1 without a failing test (a Python without pytest, say) is an error, not a kill;
    the mutated file is restored either way."""
    import importlib.util
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests" / "mutation"))
    try:
        spec = importlib.util.spec_from_file_location("mutation_run", root / "tests" / "mutation" / "run.py")
        run = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(run)
    finally:
        sys.path.pop(0)
    target = tmp_path / "code.py"
    target.write_text("x = 1\n")
    monkeypatch.setattr(run, "ROOT", tmp_path)
    monkeypatch.setattr(run, "PYTEST", [sys.executable, "-c", script])
    result = run.run_one(("m", "area", "code.py", "x = 1", "x = 2", ["tests/test_x.py"]), timeout=60)
    assert result["verdict"] == verdict
    assert target.read_text() == "x = 1\n"
