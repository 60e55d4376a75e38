"""Whether a timing may be quoted: the calibration before and after, and the load average."""
import json

from specbatch.cli import calibration


def figure(ms, load=0.5, cores=2):
    return dict(step_ms=ms, rows=8, shapes="s", load_average=load, cores=cores, threads=2)


def test_a_drift_above_ten_percent_or_a_load_of_others_above_half_the_cores_is_not_quotable():
    assert calibration.verdict(figure(10.0), figure(10.9))["quotable"]
    # the benchmark's own two threads: a load of 2.04 after the run is its own, 3.2 is another process's
    assert calibration.verdict(figure(10.0), figure(10.0, load=2.04))["quotable"]
    busy = calibration.verdict(figure(10.0), figure(10.0, load=3.2))
    assert not busy["quotable"] and "other processes kept 1.20 of the 2 cores busy" in busy["reasons"][0]
    assert calibration.verdict(figure(10.0), figure(10.0, load=2.9))["quotable"]  # 0.9: below half the cores
    drifted = calibration.verdict(figure(10.0), figure(11.2))
    assert not drifted["quotable"] and "drifted 12%" in drifted["reasons"][0]
    assert not calibration.verdict(figure(11.2), figure(10.0))["quotable"]  # faster after: drifted too
    loaded = calibration.verdict(figure(10.0, load=3.5), figure(10.0))
    assert not loaded["quotable"] and "load average 3.50 before" in loaded["reasons"][0]
    assert calibration.verdict(figure(10.0, load=None), figure(10.0, load=2.0))["quotable"]
    line = calibration.describe(figure(10.0), figure(11.2), drifted)
    assert "NOT QUOTABLE: calibration drifted 12%" in line


def test_calibrate_times_the_fixed_products_and_reads_the_load():
    c = calibration.calibrate(repeats=3)
    assert c["step_ms"] > 0 and c["rows"] == calibration.ROWS and c["cores"] >= 1
    weights = calibration.step_weights(calibration.CALIBRATION_SHAPES)
    assert len(weights) == 7 * 4 and weights[4].shape == (1536, 576) and weights[6].shape == (576, 1536)
    assert len(calibration.step_weights()) == 7 * 30 + 1  # the whole step: 30 layers and the head


def test_bench_records_both_calibrations_and_says_whether_it_may_be_quoted(folders, prompt_file, tmp_path):
    from specbatch.cli.commands import main
    out = tmp_path / "b"
    assert main(["bench", "--target", folders["target"], "--draft", folders["draft"], "--prompts", str(prompt_file),
                 "--dtype", "float64", "--max-new-tokens", "3", "--batch-sizes", "1", "--methods", "ar",
                 "--out-dir", str(out)]) == 0
    check = json.loads((out / "bench.json").read_text())["calibration"]
    assert check["before"]["step_ms"] > 0 and check["after"]["step_ms"] > 0
    assert check["verdict"] == calibration.verdict(check["before"], check["after"])
    assert calibration.describe(check["before"], check["after"], check["verdict"]) in (out / "bench.md").read_text()
