"""Data-parallel generation with torchrun on CPU (gloo, 2 processes): the output file equals a
single-process run's, for greedy decoding and both sampling modes."""
import json
import socket
import subprocess
import sys

import pytest
import torch

from hf_models import PROMPTS, save_folder, tiny
from profiles import only_full


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    target = save_folder(root / "target", tiny("llama", dtype=torch.float32))
    draft = save_folder(root / "draft", tiny("llama", layers=1, seed=9, dtype=torch.float32))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS * 2)))
    return root, target, draft, prompts


def without_rounds(path) -> list[dict]:
    """A results file's records without the run's statistics (rounds, accepted_length)."""
    return [{k: v for k, v in json.loads(line).items() if k not in ("rounds", "accepted_length")}
            for line in path.read_text().splitlines()]


@pytest.mark.parametrize("sampling", only_full([], ["--temperature", "0.9", "--sampling", "rejection", "--seed", "3"],
                                                ["--temperature", "0.9", "--sampling", "coupled", "--seed", "3"]),
                         ids=["greedy", "rejection", "coupled"])
@pytest.mark.full  # slow (a subprocess or many runs): the pre-merge profile
def test_two_processes_give_the_single_process_file(setup, sampling):
    root, target, draft, prompts = setup
    common = ["generate", "--target", target, "--draft", draft, "--prompts", str(prompts), "--dtype", "float64",
              "--max-new-tokens", "8", "--batch-size", "3", *sampling]
    mode = sampling[sampling.index("--sampling") + 1] if sampling else "greedy"  # each mode its own files
    single, double = root / f"single-{mode}.jsonl", root / f"double-{mode}.jsonl"
    run = lambda *cmd: subprocess.run(cmd, capture_output=True, text=True, timeout=180)  # noqa: E731
    one = run(sys.executable, "-m", "specbatch", *common, "--out", str(single))
    assert one.returncode == 0, one.stderr[-2000:]
    two = run(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
              "-m", "specbatch", *common, "--out", str(double))
    assert two.returncode == 0, two.stderr[-2000:]
    # the default (goodput) policy times its rounds: the tokens are the same, the rounds may differ
    assert without_rounds(double) == without_rounds(single) and len(without_rounds(single)) == 2 * len(PROMPTS)
    assert not list(root.glob(f"double-{mode}.jsonl.part*"))


def test_python_api_without_a_launcher_equals_generate():
    import specbatch
    import specbatch.distributed
    target = tiny("llama")
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8]]
    for kw in ({}, dict(temperature=0.8, seed=[1, 2, 3])):
        want = specbatch.generate(target, target, prompts, max_new_tokens=6, **kw)
        got = specbatch.distributed.generate(target, target, prompts, max_new_tokens=6, **kw)
        assert got.sequences == want.sequences and got.stop_reasons == want.stop_reasons
    assert specbatch.distributed.shard(7, 1, 3) == [1, 4]


@pytest.mark.full  # four torchrun launches
def test_killed_twice_and_resumed_under_torchrun_gives_the_uninterrupted_file(setup, tmp_path):
    """Kill a 2-process run mid-way, resume it, kill the resumed run, resume again: every result
    survives both kills (part files are appended to, never truncated) and the final file equals an
    uninterrupted single-process run's."""
    import os
    import signal
    import time
    root, target, draft, _ = setup
    prompts = tmp_path / "many.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS * 6)))
    common = ["generate", "--target", target, "--draft", draft, "--prompts", str(prompts), "--dtype", "float64",
              "--max-new-tokens", "24", "--batch-size", "1", "--policy", "threshold"]
    whole, out = tmp_path / "whole.jsonl", tmp_path / "out.jsonl"
    assert subprocess.run([sys.executable, "-m", "specbatch", *common, "--out", str(whole)], capture_output=True,
                          timeout=300).returncode == 0
    total = len(PROMPTS) * 6

    def kept() -> set:
        """The complete result lines on disk, in the output and every part file."""
        files = [out] + list(tmp_path.glob("out.jsonl.part*"))
        return {line for p in files if p.exists() for line in p.read_text().split("\n")[:-1]}

    def on_disk() -> int:
        return len(kept())

    def launch(*extra):
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "--master-port", str(free_port()), "-m", "specbatch", *common, "--out", str(out),
                                 *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def kill_after(proc, at_least: int) -> int:
        """SIGKILL the launcher and its workers (which torchrun starts in sessions of their own)."""
        deadline = time.time() + 240
        while time.time() < deadline and on_disk() < at_least and proc.poll() is None:
            time.sleep(0.02)
        for pid in [proc.pid] + [int(p) for p in os.listdir("/proc") if p.isdigit()]:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    mine = str(out).encode() in f.read()
                if pid == proc.pid or mine:
                    os.kill(pid, signal.SIGKILL)
            except OSError:  # gone already, or not ours to read
                pass
        proc.wait()
        time.sleep(0.5)  # the killed workers' files are closed
        return on_disk()

    first = kill_after(launch(), 2)
    assert 2 <= first < total
    after_first = kept()
    second = kill_after(launch("--resume"), first + 2)
    assert second < total and after_first <= kept()  # nothing the first run wrote was lost
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "-m", "specbatch", *common, "--out", str(out), "--resume"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert out.read_bytes() == whole.read_bytes() and not list(tmp_path.glob("out.jsonl.part*"))


@pytest.mark.full  # two launches each
@pytest.mark.parametrize("processes", [1, 2])
def test_killed_at_the_final_rewrite_and_resumed_gives_the_uninterrupted_file(setup, tmp_path, processes):
    """SIGKILL while --out is rewritten in input order (in one process, or rank 0 merging the part
    files of a torchrun run), then --resume: no result is lost, and the file equals an uninterrupted run's."""
    import os
    from pathlib import Path
    _, target, draft, prompts = setup
    common = ["generate", "--target", target, "--draft", draft, "--prompts", str(prompts), "--dtype", "float64",
              "--max-new-tokens", "8", "--batch-size", "3", "--policy", "threshold"]
    whole, out = tmp_path / "whole.jsonl", tmp_path / "out.jsonl"
    assert subprocess.run([sys.executable, "-m", "specbatch", *common, "--out", str(whole)], capture_output=True,
                          timeout=300).returncode == 0

    def launcher():
        return [sys.executable] + ([] if processes == 1 else
                                   ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                                    str(free_port())])
    killer = str(Path(__file__).with_name("kill_at_rewrite.py"))
    killed = subprocess.run([*launcher(), killer, *common, "--out", str(out)], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, KILL_AT_REWRITE_OF=str(out)))
    assert killed.returncode != 0, "the run was to be killed at its rewrite"
    on_disk = [out] + sorted(tmp_path.glob("out.jsonl.part*"))
    lines = {line for p in on_disk if p.exists() for line in p.read_text().splitlines()}
    assert lines == set(whole.read_text().splitlines())  # every result is on disk, not yet in input order
    if processes == 2:  # the parts are kept, and the merged file never got into place
        assert len(on_disk) == 3 and not out.exists()
    resumed = subprocess.run([*launcher(), "-m", "specbatch", *common, "--out", str(out), "--resume"],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert out.read_bytes() == whole.read_bytes() and not list(tmp_path.glob("out.jsonl.part*"))


@pytest.mark.full  # one torchrun launch
def test_a_torchrun_resume_keeps_the_results_already_in_out(setup, tmp_path):
    """A single-process run interrupted after 3 results, resumed by 2 processes: rank 0's merge starts
    from the results already in --out (not from the part files alone), so none of them vanish."""
    _, target, draft, prompts = setup
    common = ["generate", "--target", target, "--draft", draft, "--prompts", str(prompts), "--dtype", "float64",
              "--max-new-tokens", "8", "--batch-size", "3", "--policy", "threshold"]
    whole, out = tmp_path / "whole.jsonl", tmp_path / "out.jsonl"
    assert subprocess.run([sys.executable, "-m", "specbatch", *common, "--out", str(whole)], capture_output=True,
                          timeout=300).returncode == 0
    out.write_text("".join(whole.read_text().splitlines(keepends=True)[:3]))
    out.with_name("out.jsonl.settings.json").write_text(whole.with_name("whole.jsonl.settings.json").read_text())
    resumed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                              str(free_port()), "-m", "specbatch", *common, "--out", str(out), "--resume"],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming: 3 of 10 requests" in resumed.stderr
    assert out.read_bytes() == whole.read_bytes() and not list(tmp_path.glob("out.jsonl.part*"))
