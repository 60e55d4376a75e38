"""The checkers are checked too: the greedy checker's verdicts on wrong stops and ids, through
check_outputs, `conform check` and check_engine (tokens after an accepted EOS are the public bug
class of SGLang issue 31599 and transformers issue 47912)."""
import json

import pytest

from specbatch.cli.commands import main
from specbatch.conformance.greedy import check_outputs, load_vectors
from specbatch.conformance.testing import ConformanceError, check_engine


def replay_engine(vectors, tamper=None):
    """An engine that returns the vectors' reference answers (by prompt and budget), changed by
    tamper(answer, stop_reason) for every request."""
    v = load_vectors(vectors)
    answers = {}
    for r in v.requests:
        ref = v.reference[r["id"]]
        answers[(tuple(r["token_ids"]), r["max_new_tokens"])] = (ref["token_ids"], ref["stop_reason"])

    def generate_fn(prompts, max_new_tokens, eos_token_ids, batch_size):
        out = []
        for p, budget in zip(prompts, max_new_tokens):
            answer, stop = answers[(tuple(p), budget)]
            out.append(list(answer) if tamper is None else tamper(list(answer), stop))
        return out
    return generate_fn


def past_eos(answer, stop):
    return answer + [answer[-1]] if stop == "eos" else answer  # one more token after the EOS


def past_budget(answer, stop):
    return answer + [3] if stop == "length" else answer


def too_early(answer, stop):
    return answer[:-1] if stop == "eos" and len(answer) > 1 else answer  # stops before its EOS, without one


CASES = {"past-eos": (past_eos, "eos", "the output continues past the reference's end"),
         "past-budget": (past_budget, "length", "the output continues past the reference's end"),
         "too-early": (too_early, "eos", "the output stops early")}


def tampered_rows(vectors, tamper):
    """The reference answers as output rows, each changed by tamper(answer, stop_reason)."""
    v = load_vectors(vectors)
    refs = [v.reference[r["id"]] for r in v.requests]
    return [dict(id=ref["id"], token_ids=tamper(list(ref["token_ids"]), ref["stop_reason"])) for ref in refs]


@pytest.mark.parametrize("case", CASES)
def test_a_wrong_stop_is_algorithmic_at_the_reference_end(greedy_vectors, case):
    tamper, stop, detail = CASES[case]
    v = load_vectors(greedy_vectors)
    report = check_outputs(v, tampered_rows(greedy_vectors, tamper))
    refs = [v.reference[r["id"]] for r in v.requests]
    changed = {ref["id"] for ref in refs if tamper(list(ref["token_ids"]), ref["stop_reason"]) != ref["token_ids"]}
    assert changed and all(v.reference[i]["stop_reason"] == stop for i in changed)  # the vectors hold such requests
    bad = {r["id"]: r for r in report.requests if r["verdict"] != "exact"}
    assert set(bad) == changed and not report.conformant
    for ident, r in bad.items():
        end = len(v.reference[ident]["token_ids"])
        assert r["verdict"] == "algorithmic" and r["detail"] == detail
        assert r["index"] == (end if case != "too-early" else end - 1)


@pytest.mark.parametrize("case", CASES)
def test_conform_check_exits_1_on_a_wrong_stop(greedy_vectors, tmp_path, capsys, case):
    tamper, _, detail = CASES[case]
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in tampered_rows(greedy_vectors, tamper)))
    assert main(["conform", "check", str(greedy_vectors), str(out)]) == 1
    printed = capsys.readouterr().out
    assert f"({detail}" in printed and "ALGORITHMIC DIVERGENCE" in printed and "NOT CONFORMANT: " in printed


@pytest.mark.parametrize("case", CASES)
def test_check_engine_raises_on_a_wrong_stop(greedy_vectors, case):
    tamper, _, detail = CASES[case]
    check_engine(replay_engine(greedy_vectors), greedy_vectors, batch_sizes=(3,))  # the untampered replay passes
    with pytest.raises(ConformanceError, match=detail.replace("'", ".")):
        check_engine(replay_engine(greedy_vectors, tamper), greedy_vectors, batch_sizes=(3,), orders=("input",))


def test_a_duplicated_id_is_not_conformant_even_with_identical_answers(greedy_vectors, tmp_path, capsys):
    rows = tampered_rows(greedy_vectors, lambda a, s: a)
    report = check_outputs(greedy_vectors, rows + [dict(rows[0])])
    assert report.duplicated == [rows[0]["id"]] and not report.conformant
    assert all(r["verdict"] == "exact" for r in report.requests)
    out = tmp_path / "dup.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows + [rows[0]]))
    assert main(["conform", "check", str(greedy_vectors), str(out)]) == 1
    assert f"{rows[0]['id']}: appears more than once" in capsys.readouterr().out


# ---------------------------------------------------------------- invariant checkers at their edges

from specbatch.invariants import (check_alignment, check_kv, check_mask, check_positions,  # noqa: E402
                                  check_round_commit, check_stop)
from specbatch.invariants.checks import expected_visibility  # noqa: E402

CONTENT = [3, 0, 5, 1]  # row 1 is empty; row 2 fills the width; row 3 holds one token
WIDTH = max(CONTENT)


def layout():
    """A left-padded prefill layout: query and slot content indices [B, W] (-1: pad), positions, mask."""
    import numpy as np
    pad = np.array([WIDTH - n for n in CONTENT])
    index = np.arange(WIDTH)[None, :] - pad[:, None]
    index = np.where(index >= 0, index, -1)
    return index, np.maximum(index, 0), expected_visibility(index, index)


def edges():
    """(row, column) of the first and last real query of the first, last and every other non-empty row."""
    import numpy as np
    index, _, _ = layout()
    return sorted({(int(r), int(c)) for r in range(len(CONTENT)) if CONTENT[r]
                   for c in (np.nonzero(index[r] >= 0)[0][0], np.nonzero(index[r] >= 0)[0][-1])})


def test_the_edges_cover_first_and_last_rows_and_indices():
    cells = edges()
    assert {r for r, _ in cells} == {0, 2, 3} and (0, WIDTH - 3) in cells and (3, WIDTH - 1) in cells
    index, position, mask = layout()
    assert check_positions(position, index) == [] and check_mask(mask, index, index) == []
    assert check_alignment([WIDTH - n for n in CONTENT], CONTENT, WIDTH) == []


@pytest.mark.parametrize("cell", edges())
def test_a_wrong_position_at_every_edge_is_caught(cell):
    index, position, _ = layout()
    position[cell] += 1
    (v,) = check_positions(position, index)
    assert (v.invariant, v.row, v.index, v.actual) == ("I2", cell[0], index[cell], index[cell] + 1)


@pytest.mark.parametrize("cell", edges())
@pytest.mark.parametrize("slot", ["first", "last"])
def test_a_mask_entry_flipped_at_every_edge_is_caught(cell, slot):
    index, _, mask = layout()
    row, column = cell
    s = 0 if slot == "first" else WIDTH - 1  # a pad slot (hidden) or the row's first content, and the last slot
    mask[row, column, s] = not mask[row, column, s]
    (v,) = check_mask(mask, index, index)
    assert (v.invariant, v.row, v.index, v.actual) == ("I4", row, s, bool(mask[row, column, s]))


def test_an_empty_row_is_checked_for_its_width_and_leaks_into_it_are_seen():
    index, _, mask = layout()
    (v,) = check_alignment([WIDTH - n for n in CONTENT[:1]] + [WIDTH - 1] + [WIDTH - n for n in CONTENT[2:]],
                           CONTENT, WIDTH)
    assert (v.invariant, v.row) == ("I1", 1)
    # the empty row's pad queries are not checked, but a real query of the next row may not see its slots
    assert check_mask(mask, index, index) == []
    mask[2, WIDTH - 1, :] = True  # the last query of row 2 sees every slot of its row: all its own
    assert check_mask(mask, index, index) == []
    mask[3, WIDTH - 1, 0] = True  # row 3's only query sees a pad slot
    (v,) = check_mask(mask, index, index)
    assert (v.row, v.index) == (3, 0)


@pytest.mark.parametrize("row", [0, 3])
@pytest.mark.parametrize("slot", ["first", "last"])
def test_a_wrong_cache_entry_at_the_first_and_last_slot_and_row_is_caught(row, slot):
    import numpy as np
    index, _, _ = layout()
    fresh = {i: np.arange(4.0 * max(n, 1)).reshape(-1, 4) + 100 * i for i, n in enumerate(CONTENT)}
    keys = np.zeros((len(CONTENT), WIDTH, 4))
    for i, n in enumerate(CONTENT):
        keys[i, WIDTH - n:] = fresh[i][:n]
    assert check_kv(keys, index, CONTENT, fresh.__getitem__) == []
    s = WIDTH - CONTENT[row] if slot == "first" else WIDTH - 1
    keys[row, s, -1] += 1.0
    (v,) = check_kv(keys, index, CONTENT, fresh.__getitem__)
    assert (v.invariant, v.row, v.index) == ("I3", row, index[row, s])


def test_a_missing_first_or_last_cache_slot_is_caught():
    import numpy as np
    index, _, _ = layout()
    keys = np.zeros((len(CONTENT), WIDTH, 4))
    for s in (WIDTH - CONTENT[2], WIDTH - 1):  # row 2's first and last content
        hole = index.copy()
        hole[2, s] = -1
        (v,) = check_kv(keys, hole, CONTENT, lambda i: np.zeros((max(CONTENT[i], 1), 4)))
        assert (v.invariant, v.row, v.actual) == ("I3", 2, CONTENT[2] - 1)


def test_round_commit_at_its_edges():
    import numpy as np
    choice = np.array([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    drafted = np.array([[9, 6, 7], [5, 6, 7], [5, 6, 9]])  # none accepted, all accepted, two accepted
    limit, remaining, eos = [3, 3, 3], [9, 9, 9], [0]
    want = [[5], [5, 6, 7, 8], [5, 6, 7]]
    assert check_round_commit(drafted, choice, limit, [0, 3, 2], want, remaining, eos) == []
    for row, accepted in ((0, [1, 3, 2]), (1, [0, 2, 2]), (2, [0, 3, 3])):  # first row, the limit, the last row
        (v,) = check_round_commit(drafted, choice, limit, accepted, want, remaining, eos)
        assert (v.invariant, v.row) == ("I5", row)
    longer = [w + [1] for w in want]
    for row in (0, 2):
        got = [longer[i] if i == row else want[i] for i in range(3)]
        (v,) = check_round_commit(drafted, choice, limit, [0, 3, 2], got, remaining, eos)
        assert (v.invariant, v.row, v.index) == ("I6", row, len(want[row]))
    # a budget of one token, and an EOS at the first new token, end the commit of an all-accepted row
    assert check_round_commit(drafted, choice, limit, [0, 3, 2], [[5], [5], [5, 6, 7]], [9, 1, 9], eos) == []
    (v,) = check_round_commit(drafted, choice, limit, [0, 3, 2], [[5], [5, 6], [5, 6, 7]], [9, 1, 9], eos)
    assert (v.invariant, v.row, v.index) == ("I6", 1, 1)
    # with 5 an EOS every row stops at its first new token: rows 1 and 2 kept tokens past it
    assert [(v.invariant, v.row, v.index) for v in check_round_commit(drafted, choice, limit, [0, 3, 2], want,
                                                                      remaining, [5])] == [("I6", 1, 1), ("I6", 2, 1)]


def test_stop_at_its_edges():
    assert check_stop([], {0}, 0) == [] and check_stop([0], {0}, 1) == [] and check_stop([4], {0}, 1) == []
    assert [(v.index, v.actual) for v in check_stop([0, 4], {0}, 8)] == [(1, 2)]  # EOS at the first token
    assert [(v.index, v.actual) for v in check_stop([4, 0, 0], {0}, 8)] == [(2, 3)]  # one token after an EOS
    assert [(v.index, v.actual) for v in check_stop([4, 4], {0}, 1)] == [(1, 2)]  # one past the budget
    assert [(v.index, v.actual) for v in check_stop([], {0}, 1)] == [(0, 0)]  # an empty answer with a budget


# ---------------------------------------------------------------- per-request statistics

@pytest.mark.parametrize("strategy", ["eqspec", "exspec", "ragged"])
@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.9, seed=5)], ids=["greedy", "sampled"])
def test_per_request_statistics_equal_the_trace_under_pooling(tmp_path, strategy, sampling):
    """Nine requests of different budgets through batches of three: rows finish at different rounds
    and their places are refilled (exspec regroups them by length); each request's rounds and
    accepted length are what the trace's rows say, and they add up to the run's totals."""
    import random

    import specbatch
    from hf_models import EOS, FIXED_K, tiny
    from specbatch.fast.drafts.scripted import ScriptedDraft
    from specbatch.reference import deviate_hashed
    target = tiny("llama")
    rnd = random.Random(0)
    prompts = [[rnd.randrange(8, 90) for _ in range(rnd.randrange(1, 12))] for _ in range(9)]
    trace = tmp_path / "trace.jsonl"
    result = specbatch.generate(target, ScriptedDraft(target, deviate_hashed(3, 0.3)), prompts,
                                max_new_tokens=[3 + 2 * i for i in range(9)], batch_size=3, strategy=strategy,
                                trace=str(trace), eos_token_id=[EOS], **FIXED_K, **sampling)
    rounds, committed, batches = [0] * 9, [0] * 9, set()
    for line in trace.read_text().splitlines():
        record = json.loads(line)
        if "round" in record:
            batches.add(tuple(sorted(row["request"] for row in record["rows"])))
            for row in record["rows"]:
                rounds[row["request"]] += 1
                committed[row["request"]] += len(row["committed"])
    assert len(batches) > 3  # requests met other requests than their first batch's
    assert committed == [len(s) for s in result.sequences]
    assert [s["rounds"] for s in result.request_stats] == rounds
    per_round = [c / r for c, r in zip(committed, rounds)]
    assert [s["accepted_length"] for s in result.request_stats] == pytest.approx(per_round)
    assert sum(committed) == result.stats["generated_tokens"]
    assert result.stats["mean_accepted_length"] == pytest.approx(sum(committed) / sum(rounds))


# ---------------------------------------------------------------- the sampled checker's parts, on a small case

@pytest.fixture(scope="module")
def small_case():
    """One setting (temperature 1, no truncation), one request, 32 rows of 2 tokens: rows 0-27 take
    the most likely path (a, b), rows 28-29 stop at EOS, rows 30-31 take (c, d), two unlikely tokens."""
    import torch

    from specbatch.conformance.sampled import reference_probs, sampled_vectors
    from specbatch.conformance.testing import toy_sampling_pair
    target, _ = toy_sampling_pair()
    setting = dict(name="t1", temperature=1.0, top_k=None, top_p=None)
    vectors = sampled_vectors(target, samples=32, requests_per_setting=1, max_new_tokens=2, settings=[setting], seed=4)
    prompt, eos = vectors.rows[0]["token_ids"], vectors.manifest["eos_token_ids"][0]

    def probs(prefix):
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([prompt + prefix])).logits[0, -1]
        return reference_probs(logits, 1.0, None, None).numpy()
    root = probs([])
    a = int(root.argmax())
    b = int(probs([a]).argmax())
    c = int(root.argsort()[5])
    d = int(probs([c]).argsort()[5])
    assert eos not in (a, c)
    answers = [[a, b]] * 28 + [[eos]] * 2 + [[c, d]] * 2
    outputs = [dict(id=r["id"], token_ids=t) for r, t in zip(vectors.rows, answers)]
    return target, vectors, outputs, probs, (a, b, c, d, eos)


def test_the_tree_part_tests_the_nodes_of_25_or_more_rows_with_cochran_cells(small_case):
    from specbatch.conformance.sampled import _cells, check_samples
    target, vectors, outputs, probs, (a, b, c, d, eos) = small_case
    report = check_samples(vectors, outputs, target)
    (s,) = report.settings
    assert (s["rows"], s["tokens"], s["nodes"]) == (32, 62, 2)  # the root (32 rows) and the prefix a (28 rows)
    want_x2, want_df = 0.0, 0
    for prefix, observed in (([], {a: 28, eos: 2, c: 2}), ([a], {b: 28})):
        p = probs(prefix)
        n = sum(observed.values())
        tokens, cell_p = _cells(p, n)
        counts = [observed.get(t, 0) for t in tokens] + [n - sum(observed.get(t, 0) for t in tokens)]
        cell_p = cell_p + [1 - sum(cell_p)]
        want_x2 += sum((o - n * q) ** 2 / (n * q) for o, q in zip(counts, cell_p) if q > 0)
        want_df += sum(q > 0 for q in cell_p) - 1
    assert (s["tree_x2"], s["tree_df"]) == (pytest.approx(want_x2), want_df) and want_df >= 1


def test_the_rank_part_sees_every_token_outside_the_tested_nodes(small_case):
    from specbatch.conformance.sampled import check_samples
    target, vectors, outputs, _, _ = small_case
    (s,) = check_samples(vectors, outputs, target).settings
    assert s["rank_tokens"] == 2  # the second tokens of rows 30-31 (a node of 2 rows)
    few = [dict(o) for o in outputs]
    for o in few[:20]:  # rows 0-19 take (c, d): second tokens at a node of 8 rows (prefix a) and of 22 (prefix c)
        o["token_ids"] = few[30]["token_ids"]
    (s,) = check_samples(vectors, few, target).settings
    assert (s["nodes"], s["rank_tokens"], s["tokens"]) == (1, 8 + 22, 62)  # only the root is tested
    from specbatch.conformance.sampled import sampled_vectors
    small = sampled_vectors(target, samples=8, requests_per_setting=2, max_new_tokens=2, settings=vectors.settings(),
                            seed=4)  # nodes of 8 rows: every token, at every position, goes to the rank part
    rows = [dict(id=r["id"], token_ids=outputs[i % 28]["token_ids"]) for i, r in enumerate(small.rows)]
    (s,) = check_samples(small, rows, target).settings
    assert (s["nodes"], s["rank_tokens"], s["tokens"]) == (0, 32, 32)


def test_cochran_cells_merge_the_rest_only_when_it_is_small():
    from specbatch.conformance.sampled import _cells
    import numpy as np
    assert _cells(np.array([0.5, 0.3, 0.15, 0.05]), 100) == ([0, 1, 2], [0.5, 0.3, 0.15])  # rest 0: merged
    assert _cells(np.array([0.5, 0.3, 0.1, 0.04, 0.03, 0.03]), 100) == ([0, 1, 2], [0.5, 0.3, 0.1])  # rest 10: own cell
    assert _cells(np.array([0.02] * 50), 100) == ([], [])  # no token expected 5 times


def test_independence_counts_every_pair_early_stops_included_with_its_exact_tail(small_case):
    from specbatch.conformance.sampled import check_samples, poisson_binomial_sf
    target, vectors, outputs, probs, (a, b, c, d, eos) = small_case
    report = check_samples(vectors, outputs, target)
    twins, slots = report.independence
    path = {(a, b): probs([])[a] * probs([a])[b], (eos,): probs([])[eos], (c, d): probs([])[c] * probs([c])[d]}
    answers = [tuple(o["token_ids"]) for o in outputs]
    twin_probs = [path[answers[g]] for g in range(0, 32, 2)]
    assert (twins["pairs"], twins["identical"]) == (16, 16)  # the EOS pair (rows 28, 29) counts
    assert twins["expected"] == pytest.approx(sum(twin_probs))
    assert twins["p"] == pytest.approx(poisson_binomial_sf(twin_probs, 16))
    slot_firsts = [g for g in range(30) if (g // 2) % 2 == 0]  # rows g and g + 2, batch size 2
    assert (slots["pairs"], slots["identical"]) == (16, sum(answers[g] == answers[g + 2] for g in slot_firsts))
    assert slots["identical"] == 14  # (28, 30) and (29, 31): an EOS row against a (c, d) row


def test_the_position_bound_uses_the_dkw_margin_of_its_own_token_count(small_case):
    import math

    from specbatch.conformance.sampled import ALPHA, check_samples, dkw_margin, tv_lower_bound
    target, vectors, outputs, _, _ = small_case
    report = check_samples(vectors, outputs, target)
    assert [(p["position"], p["tokens"]) for p in report.positions] == [(0, 32), (1, 30)]
    cells = 1 * 2  # settings x positions
    for p in report.positions:
        assert p["margin"] == pytest.approx(math.sqrt(math.log(2 / (ALPHA / cells)) / (2 * p["tokens"])))
    assert dkw_margin(200, 0.01) == pytest.approx(math.sqrt(math.log(200) / 400))
    assert tv_lower_bound(dict(ks=0.3, margin=0.1)) == pytest.approx(0.2)
    assert tv_lower_bound(dict(ks=0.1, margin=0.3)) == 0


def test_a_planted_deviation_moves_the_stated_mass_and_nothing_else():
    """planted_engine: with tv 0 it is target-only sampling token for token; with tv 0.2 at the first
    position only, each planted token's TV distance is min(0.2, P(top)) and positions past it are
    drawn as target-only sampling draws them given the same first token."""
    from specbatch.conformance.sampled import sampled_vectors
    from specbatch.conformance.sampling_engines import planted_engine, sampling_engine
    from specbatch.conformance.testing import toy_sampling_pair
    target, _ = toy_sampling_pair()
    v = sampled_vectors(target, samples=8, seed=2)
    s = v.settings()[0]
    rows = v.rows_of(s["name"])
    call = dict(temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"], seeds=[r["seed"] for r in rows])
    args = ([r["token_ids"] for r in rows], [r["max_new_tokens"] for r in rows], v.manifest["eos_token_ids"], 4)
    exact = sampling_engine(target)(*args, **call)
    assert planted_engine(target, 0.0)(*args, **call) == exact
    planted = planted_engine(target, 0.2, {0})
    got = planted(*args, **call)
    assert len(planted.planted) == len(rows) and all(0 < d <= 0.2 + 1e-12 for d in planted.planted)
    assert any(g[0] != e[0] for g, e in zip(got, exact))
    assert all(g[1:] == e[1:] for g, e in zip(got, exact) if g[0] == e[0])
