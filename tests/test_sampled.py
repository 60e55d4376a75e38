"""The sampled conformance checker: its statistics, its null distribution (p-values uniform over
simulated runs), its power against the broken sampling engines, and real engines passing it."""
import itertools
import json
import math

import numpy as np
import pytest
import torch

from hf_models import tiny
from specbatch.fast.sampling import processed_log_probs
from specbatch.conformance.sampled import (ALPHA, SETTINGS, _node_ids, check_samples, chi2_sf, load_sampled_vectors,
                               make_sampled_vectors, poisson_binomial_sf, reference_probs, sampled_vectors,
                               tv_lower_bound)
from specbatch.conformance.sampling_engines import sampling_engine
from specbatch.conformance.testing import (ConformanceError, check_sampling, hf_sampling_engine, run_sampled, sampled_power,
                               specbatch_sampling_engine, toy_sampling_pair)

TOY = toy_sampling_pair()


def kolmogorov_p(values) -> float:
    """P-value of the one-sample KS test of `values` against Uniform(0, 1) (Kolmogorov's limit with
    Stephens' small-sample correction)."""
    u = np.sort(np.asarray(values))
    n = len(u)
    d = max((np.arange(1, n + 1) / n - u).max(), (u - np.arange(n) / n).max())
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    return float(min(1.0, max(0.0, 2 * sum((-1) ** (j - 1) * math.exp(-2 * j * j * lam * lam) for j in range(1, 101)))))


# ---------------------------------------------------------------- statistics


def test_reference_semantics_are_the_engine_processors():
    logits = torch.randn(40, 30, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    for s in SETTINGS:
        got = reference_probs(logits, s["temperature"], s["top_k"], s["top_p"])
        want = processed_log_probs(logits, s["temperature"], s["top_k"], s["top_p"]).exp()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
        assert torch.allclose(got.sum(-1), torch.ones(40, dtype=torch.float64))


def test_the_slack_admits_only_tokens_at_a_boundary():
    probs = torch.tensor([0.5, 0.35, 0.15 - 1e-6, 1e-6], dtype=torch.float64)
    logits = probs.log()[None]
    strict = reference_probs(logits, 1.0, None, 0.8495)[0]  # 0.5 + 0.35 reach 0.8495: the third is out
    assert strict[1] > 0 and strict[2] == 0 and strict[3] == 0
    wide = reference_probs(logits, 1.0, None, 0.8495, slack=1e-3)[0]
    assert wide[2] > 0 and wide[3] == 0  # mass before the third, 0.85, is within 0.8495 + 0.001
    assert reference_probs(logits, 1.0, 2, None, slack=1e-3)[0][2] == 0  # far below the 2nd logit
    near = torch.tensor([[5.0, 3.0, 3.0 - 1e-4, 0.0]], dtype=torch.float64)  # the 3rd within the slack of the 2nd
    assert (reference_probs(near, 1.0, 2, None)[0] > 0).tolist() == [True, True, False, False]
    assert (reference_probs(near, 1.0, 2, None, slack=1e-3)[0] > 0).tolist() == [True, True, True, False]


def test_the_top_p_slack_admits_a_token_that_rounding_can_rank_above_the_last_kept():
    """Under top-p the last kept token and a next one within rounding of its logit can swap places in
    an engine whose logits round differently (seen: llama.cpp's float32 GGUF, logits 0.002 apart)."""
    logits = torch.tensor([[3.0, 2.5, 1.0, 1.0 - 1e-4, 0.0]], dtype=torch.float64)
    strict = reference_probs(logits, 1.0, None, 0.85)[0]  # mass before the 4th: 0.904
    assert (strict > 0).tolist() == [True, True, True, False, False]
    wide = reference_probs(logits, 1.0, None, 0.85, slack=1e-3)[0]
    assert (wide > 0).tolist() == [True, True, True, True, False]  # within 1e-3 * (1 + 1.0) of the last kept
    apart = torch.tensor([[3.0, 2.5, 1.0, 1.0 - 1e-2, 0.0]], dtype=torch.float64)
    assert (reference_probs(apart, 1.0, None, 0.85, slack=1e-3)[0] > 0).tolist() == [True, True, True, False, False]


def test_sampled_vectors_take_the_eos_ids_an_engine_stops_at():
    from specbatch.conformance.greedy import VectorError
    target, _ = TOY
    vectors = sampled_vectors(target, samples=4, eos_token_ids=[63, 0])
    assert vectors.manifest["eos_token_ids"] == [63, 0] and all(r["eos_token_ids"] == [63, 0] for r in vectors.rows)
    default = sampled_vectors(target, samples=4)
    assert [dict(r, eos_token_ids=None) for r in default.rows] == [dict(r, eos_token_ids=None) for r in vectors.rows]
    with pytest.raises(VectorError, match="vocabulary"):
        sampled_vectors(target, samples=4, eos_token_ids=[64])


def test_poisson_binomial_tail_is_exact():
    probs = [0.1, 0.5, 0.03, 0.7, 0.25]
    for observed in range(len(probs) + 2):
        brute = sum(math.prod(p if bit else 1 - p for p, bit in zip(probs, bits))
                    for bits in itertools.product((0, 1), repeat=len(probs)) if sum(bits) >= observed)
        assert poisson_binomial_sf(probs, observed) == pytest.approx(brute, abs=1e-12)


def test_chi_square_tail():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(4.0, 2) == pytest.approx(math.exp(-2.0), rel=1e-12)
    assert chi2_sf(0.0, 5) == 1.0 and chi2_sf(7.0, 0) == 1.0


def test_prompt_cache_gives_the_logits_of_whole_sequences():
    """The checker runs each prompt once and its continuations on a copy of its cache: the same
    conditionals as a forward over every whole sequence (float64)."""
    import specbatch.conformance.sampled as sampled
    target = tiny("llama", seed=0)
    prompts = [[5, 9, 2, 40], [5, 9, 2, 40], [7, 1], [5, 9, 2, 40]]
    conts = [[3, 8, 8], [3], [11, 12, 13, 14], [60, 61]]
    got = torch.cat([flat for _, _, flat in sampled._continuation_logits(target, prompts, conts)])
    with torch.inference_mode():
        want = torch.cat([target(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:len(p) - 1 + len(c)]
                          for p, c in zip(prompts, conts)])
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-9, atol=1e-9)


def test_node_ids_group_rows_by_request_and_prefix():
    tokens = np.array([[1, 2, 3], [1, 2, 4], [1, 5, 3], [1, 2, 3]])
    node = _node_ids(np.array([0, 0, 0, 1]), tokens, np.array([3, 3, 3, 3]), vocab=8)
    assert len(set(node[:, 0])) == 2  # two requests
    assert node[0, 1] == node[1, 1] == node[2, 1] != node[3, 1]  # prefix (1); row 3 is another request
    assert node[0, 2] == node[1, 2] != node[2, 2]  # prefixes (1, 2) and (1, 5)
    assert node[3, 2] not in node[:3, 2]


# ---------------------------------------------------------------- verdicts on the toy pair


def test_correct_samplers_pass_and_the_report_names_each_part():
    target, draft = TOY
    vectors = sampled_vectors(target, seed=1)
    for engine in (sampling_engine(target, None), sampling_engine(target, draft)):
        outputs = run_sampled(engine, vectors)
        report = check_samples(vectors, outputs, target)
        assert report.conformant, report.table()
        assert [s["name"] for s in report.settings] == [s["name"] for s in SETTINGS]
        assert sum(s["tokens"] for s in report.settings) == sum(len(o["token_ids"]) for o in outputs)
        assert {d["kind"] for d in report.independence} == {"twin", "slot"}
        assert len(report.p_values()) == 2 * len(SETTINGS) + 3 and report.threshold == ALPHA / 15
        assert report.tail["tokens"] == sum(s["tokens"] for s in report.settings) and report.tail["p"] > ALPHA / 15
        # the TV column is the lower bound (KS statistic less its DKW margin): 0 here, not the statistic
        tv = report.table().split("TV gap by position")[1].split("support violations")[0]
        assert all(tv_lower_bound(r) == 0 < r["ks"] for r in report.positions)
        assert "*" not in tv and tv.count(":0.000") == len(report.positions)


FLAGGED_BY = {  # the part of the check that must reject each bug at the default size (one run)
    "draft-without-temperature": "tree", "draft-argmax": "tree", "residual-unnormalised": "tree",
    "bonus-from-draft": "support", "truncation-target-only": "tree", "temperature-after-truncation": "support",
    "shared-stream": "independence twin", "slot-keyed": "independence slot",
}


def one_bug_per_part() -> list:
    """Every bug; the default profile runs the first (alphabetical) bug of each part, --full all."""
    first = {}
    for bug in sorted(FLAGGED_BY):
        first.setdefault(FLAGGED_BY[bug], bug)
    return [bug if bug in first.values() else pytest.param(bug, marks=pytest.mark.full) for bug in sorted(FLAGGED_BY)]


@pytest.mark.parametrize("bug", one_bug_per_part())
def test_each_broken_sampler_is_flagged_by_its_part(bug):
    target, draft = TOY
    vectors = sampled_vectors(target, seed=2)
    report = check_samples(vectors, run_sampled(sampling_engine(target, draft, bug=bug), vectors), target)
    assert not report.conformant
    part = FLAGGED_BY[bug]
    if bug == "draft-argmax":  # a gap this large shows in the TV lower bounds, starred, and in the lines
        assert any(tv_lower_bound(r) > 0 for r in report.positions) and "*" in report.table()
        assert any(line.endswith("tokens)") and "TV gap >= 0.0" not in line for line in report.lines())
    if part == "support":
        assert report.violations and "outside the kept set" in report.lines()[0]
    else:
        assert min(p for name, p in report.p_values() if part in name) < report.threshold, report.table()


def test_malformed_outputs_are_errors_named_by_row():
    target, _ = TOY
    vectors = sampled_vectors(target, seed=1, samples=4)
    outputs = run_sampled(sampling_engine(target, None), vectors)
    eos = vectors.manifest["eos_token_ids"][0]
    other = 1 if eos != 1 else 2
    outputs[0]["token_ids"] = [other] * (vectors.rows[0]["max_new_tokens"] + 1)  # past the budget
    outputs[1]["token_ids"] = [eos, 1]  # past its EOS
    outputs[2]["token_ids"] = [other]  # stopped early, no EOS
    missing = outputs.pop(3)["id"]
    outputs.append(dict(outputs[4]))  # given twice
    report = check_samples(vectors, outputs, target)
    assert not report.conformant
    text = "\n".join(report.lines())
    for ident, problem in ((outputs[0]["id"], "past the budget"), (outputs[1]["id"], "past the EOS"),
                           (outputs[2]["id"], "before its budget"), (missing, "no output"),
                           (outputs[4]["id"], "more than once")):
        assert any(ident in line and problem in line for line in report.lines()), (problem, text)


def test_a_token_outside_the_kept_set_is_a_violation():
    target, _ = TOY
    vectors = sampled_vectors(target, seed=1, samples=32)
    outputs = run_sampled(sampling_engine(target, None), vectors)
    row = next(i for i, r in enumerate(vectors.rows) if r["top_k"] == 5)
    ids = torch.tensor([vectors.rows[row]["token_ids"]])
    worst = int(target(input_ids=ids).logits[0, -1].argmin())
    outputs[row]["token_ids"][0] = worst
    report = check_samples(vectors, outputs, target)
    assert (vectors.rows[row]["id"], 0, worst) in report.violations and report.p_value() == 0.0
    for i, r in enumerate(vectors.rows):  # every sample of the request: a tested node with no token left
        if r["request"] == vectors.rows[row]["request"]:
            outputs[i]["token_ids"][0] = worst
    report = check_samples(vectors, outputs, target)
    first = {ident for ident, position, _ in report.violations if position == 0}
    malformed = {line.split(":")[0] for line in report.errors}  # a row that had stopped at its first token
    assert first == {r["id"] for r in vectors.rows if r["request"] == vectors.rows[row]["request"]} - malformed


def test_vectors_on_disk_round_trip_and_tampering_is_refused(tmp_path):
    from specbatch.conformance.greedy import VectorError
    target, _ = TOY
    manifest = make_sampled_vectors(target, tmp_path / "v", samples=8)
    vectors = load_sampled_vectors(tmp_path / "v")
    assert manifest["num_rows"] == len(vectors.rows) == 8 * 2 * len(SETTINGS)
    assert vectors.rows == sampled_vectors(target, samples=8).rows
    rows = (tmp_path / "v" / "rows.jsonl").read_text().splitlines()
    (tmp_path / "v" / "rows.jsonl").write_text("\n".join(rows[:-1]) + "\n")
    with pytest.raises(VectorError, match="SHA-256"):
        load_sampled_vectors(tmp_path / "v")


# ---------------------------------------------------------------- real engines pass


@pytest.mark.parametrize("engine", ["specbatch-rejection", "specbatch-coupled", "transformers-sample"])
def test_real_engines_pass_on_a_tiny_model(engine):
    target = tiny("llama", seed=0, dtype=torch.float32)
    draft = tiny("llama", layers=1, seed=1, dtype=torch.float32)
    make = {"specbatch-rejection": lambda: specbatch_sampling_engine(target, draft, "rejection"),
            "specbatch-coupled": lambda: specbatch_sampling_engine(target, draft, "coupled"),
            "transformers-sample": lambda: hf_sampling_engine(target)}[engine]
    vectors = sampled_vectors(target, seed=4, samples=32)
    report = check_sampling(make(), vectors, target, batch_size=8)
    assert report.conformant and not report.violations


@pytest.mark.full
def test_transformers_assisted_sampling_passes():
    target = tiny("llama", seed=0, dtype=torch.float32)
    draft = tiny("llama", layers=1, seed=1, dtype=torch.float32)
    report = check_sampling(hf_sampling_engine(target, draft), sampled_vectors(target, seed=5, samples=32), target)
    assert report.conformant


def test_the_pytest_fixture_judges_sampled_engines(specbatch_check_sampling):
    target, draft = TOY
    vectors = sampled_vectors(target, samples=32)
    assert specbatch_check_sampling(sampling_engine(target, draft), vectors, target).conformant
    with pytest.raises(ConformanceError):
        specbatch_check_sampling(sampling_engine(target, draft, bug="slot-keyed"), vectors, target)


def test_check_sampling_raises_with_the_table():
    target, draft = TOY
    with pytest.raises(ConformanceError, match="independence twin"):
        check_sampling(sampling_engine(target, draft, bug="shared-stream"), sampled_vectors(target, samples=32), target)


# ---------------------------------------------------------------- simulation: null and power


@pytest.mark.full
def test_p_values_are_uniform_under_the_null():
    """200 runs of exact target-only sampling at the default size, on three of the six settings
    (temperature below and above 1, top-k, top-p, and top-k with top-p; half the cost of all six):
    the chi-square parts' p-values pass a KS test for uniformity, the exact independence and tail
    p-values are never below their level more often than allowed, and the whole check raises at
    most one false alarm."""
    target, _ = TOY
    chosen = [s for s in SETTINGS if s["name"] in ("t1.0-k5", "t1.3-p0.7", "t0.7-k10-p0.8")]
    reports = sampled_power(sampling_engine(target, None), target, runs=200, seed=1000, settings=chosen)
    for part in ("tree", "rank"):
        values = [p for r in reports for name, p in r.p_values() if name.endswith(part)]
        assert len(values) == 200 * len(chosen)
        assert kolmogorov_p(values) > 0.001, part
    exact = {kind: [d["p"] for r in reports for d in r.independence if d["kind"] == kind] for kind in ("twin", "slot")}
    exact["tail"] = [r.tail["p"] for r in reports]
    for kind, values in exact.items():  # discrete: P(p <= level) <= level
        values = np.array(values)
        for level in (0.05, 0.2, 0.5):
            assert (values <= level).mean() <= level + 3 * math.sqrt(level / len(values)), kind
    assert sum(not r.conformant for r in reports) <= 1


@pytest.mark.full
def test_correct_speculative_sampling_raises_no_false_alarm():
    target, draft = TOY
    reports = sampled_power(sampling_engine(target, draft), target, runs=10, seed=2000)
    assert all(r.conformant for r in reports)


@pytest.mark.full
@pytest.mark.parametrize("bug", sorted(FLAGGED_BY))
def test_power_against_each_broken_sampler(bug):
    """3 runs at the default size: every one rejected (benchmarks/sampled_power.py measures 100 and
    records them in docs/results/sampled-power)."""
    target, draft = TOY
    reports = sampled_power(sampling_engine(target, draft, bug=bug), target, runs=3, seed=3000)
    assert len(reports) == 3 and all(not r.conformant for r in reports)


def test_cli_make_sample_and_check(folders, prompt_file, tmp_path, capsys):
    """conform make --sampled, conform sample (specbatch rejection), conform check: exit 0; a broken
    output file: exit 1 naming the problem; a missing --target or unreadable outputs: exit 2."""
    from specbatch.cli.commands import main
    vectors = tmp_path / "sampled"
    assert main(["conform", "make", "--sampled", "--target", str(folders["target"]), "--samples", "16",
                 "--prompts", str(prompt_file), "--out", str(vectors)]) == 0
    assert "settings x 2 requests x 16 samples" in capsys.readouterr().out
    outputs = tmp_path / "out.jsonl"
    assert main(["conform", "sample", str(vectors), "--target", str(folders["target"]), "--draft",
                 str(folders["draft"]), "--batch-size", "8", "--out", str(outputs)]) == 0
    capsys.readouterr()
    assert main(["conform", "check", str(vectors), str(outputs), "--target", str(folders["target"]),
                 "--batch-size", "8"]) == 0
    assert "CONFORMANT: p = " in capsys.readouterr().out
    rows = [json.loads(line) for line in outputs.read_text().splitlines()]
    rows[0]["token_ids"] = rows[0]["token_ids"] * 3  # past its budget
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["conform", "check", str(vectors), str(broken), "--target", str(folders["target"])]) == 1
    assert f"{rows[0]['id']}: " in capsys.readouterr().out
    assert main(["conform", "check", str(vectors), str(outputs)]) == 2
    assert "--target is required" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"id": \n')
    assert main(["conform", "check", str(vectors), str(tmp_path / "bad.jsonl"), "--target", str(folders["target"])]) == 2


# ---------------------------------------------------------------- token trees (multi-candidate rejection)

@pytest.mark.full  # slow (a subprocess or many runs): the pre-merge profile
def test_the_textbook_sampler_over_token_trees_passes_and_its_tree_bugs_are_flagged():
    """The textbook sampler with 3 candidates per position (proofs_notes/trees.md, Lemma T6) passes at
    the default size; ranked leaves tested as if drawn (rejected in 100 of 100 runs of the power table;
    tree-residual-stale in 94: tests/test_sampling.py's chi-square rejects it) fail the prefix tree."""
    target, draft = TOY
    vectors = sampled_vectors(target, seed=2)
    report = check_samples(vectors, run_sampled(sampling_engine(target, draft, tree_branches=3), vectors), target)
    assert report.conformant and not report.violations, report.table()
    for bug in ["tree-ranked-leaves"]:
        broken = check_samples(vectors, run_sampled(sampling_engine(target, draft, bug=bug, tree_branches=3), vectors),
                               target)
        assert not broken.conformant
        assert min(p for name, p in broken.p_values() if "tree" in name) < broken.threshold, broken.table()
    with pytest.raises(ValueError, match="needs tree_branches >= 2"):
        sampling_engine(target, draft, bug="tree-ranked-leaves")


def test_the_binomial_tail_is_exact():
    from specbatch.conformance.sampled import binomial_sf
    for n, p in ((50, 0.01), (7, 0.5), (300, 0.001)):
        for k in (0, 1, 2, 3, n // 2, n, n + 1):
            want = sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))
            assert binomial_sf(k, n, p) == pytest.approx(want, rel=1e-9, abs=1e-300)


@pytest.mark.full  # slow (a subprocess or many runs): the pre-merge profile
def test_the_tail_test_catches_a_few_tokens_the_target_almost_never_draws():
    """Penalties at draft positions that miss the round's earlier drafts put a few repeated tokens
    where the target gives them almost nothing. In this run the tree test dilutes them into its rest
    cells and the rank test into its last bin; the tail test (randomised PIT beyond 1 - TAIL_MASS,
    pooled, exact binomial) rejects. A correct engine's tail count is as the binomial says."""
    from specbatch.conformance.sampled import TAIL_MASS
    target, draft = TOY
    broken = sampled_power(sampling_engine(target, draft, "penalties-drafts-ignored"), target, runs=1, seed=1003,
                           processors=True)[0]
    assert not broken.conformant
    assert [name for name, p in broken.p_values() if p < broken.threshold] == ["tail"]
    assert broken.tail["observed"] > 3 * broken.tail["expected"]
    exact = sampled_power(sampling_engine(target, draft), target, runs=1, seed=1003, processors=True)[0]
    assert exact.conformant and exact.tail["p"] > 0.01
    assert exact.tail["expected"] == pytest.approx(exact.tail["tokens"] * TAIL_MASS)
    assert "tail:" in exact.table()


def test_an_engine_returning_its_drafts_logprobs_is_rejected_whatever_its_samples():
    """sampled_power(logprobs_from=model): the engine's rows carry that model's raw logprobs and the
    checker judges them; the target's pass, the draft's are wrong at every token (its samples are right)."""
    target, draft = TOY
    engine = sampling_engine(target, draft)
    right, = sampled_power(engine, target, runs=1, seed=7, samples=16, logprobs_from=target)
    wrong, = sampled_power(engine, target, runs=1, seed=7, samples=16, logprobs_from=draft)
    assert right.conformant and not right.logprob_errors and right.logprobs_checked > 0
    assert not wrong.conformant and wrong.p_value() == 0
    assert len(wrong.logprob_errors) == wrong.logprobs_checked == right.logprobs_checked
