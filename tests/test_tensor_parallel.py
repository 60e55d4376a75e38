"""Tensor parallelism on CPU with gloo, under torch.distributed.run: a target sharded by
transformers' own plan decodes exactly as the unsharded target in float64 and as the same sharding
without a draft in float32 (against the unsharded run, float32 may differ at floating-point ties
only); data and tensor parallelism together write the single-process file, also after a rank is
killed and the run resumed."""
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import specbatch
from hf_models import PROMPTS, save_folder, tiny
from specbatch.fast.equivalence import compare
from specbatch.tensor_parallel import Parallel, TensorParallelError, check_shardable, layout
from test_distributed import free_port

WORKER = str(Path(__file__).with_name("tp_worker.py"))
PROMPT_IDS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11], [12], [13, 14, 15, 16], [17, 18, 19]]  # as tp_worker's


def noisy_copy(model, scale: float = 0.3, seed: int = 1):
    """A draft that agrees with `model` part of the time: its weights plus noise of `scale` of each
    tensor's spread (mean accepted length about 1.5-1.7 proposals at k = 3 for the tiny models)."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * scale * p.std())
    return draft


def torchrun(processes: int, *argv, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
                           "--master-port", str(free_port()), *argv], capture_output=True, text=True,
                          timeout=timeout)


def sharded_runs(tmp_path, arch: str, dtype: torch.dtype):
    """(whole target, draft, the tp_worker's runs on the target sharded over 2 ranks). The Llama
    target ties its output head to its input embedding (as SmolLM2 does): one weight, two plan rules."""
    target = tiny(arch, dtype=dtype, tie_word_embeddings=arch == "llama")
    draft = noisy_copy(target)
    save_folder(tmp_path / "target", target)
    save_folder(tmp_path / "draft", draft)
    out = tmp_path / "runs.json"
    name = {torch.float64: "float64", torch.float32: "float32"}[dtype]
    done = torchrun(2, WORKER, str(tmp_path / "target"), str(tmp_path / "draft"), name, str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return target, draft, json.loads(out.read_text())


@pytest.mark.full  # a torchrun launch; the default profile's torchrun test is the data-parallel one
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_float64_sharded_decoding_equals_the_unsharded_target_for_every_strategy(tmp_path, arch):
    target, draft, runs = sharded_runs(tmp_path, arch, torch.float64)
    whole = specbatch.generate(target, None, PROMPT_IDS, max_new_tokens=10, batch_size=1).sequences
    for name in ("target-only", "eqspec", "exspec", "ragged", "distributed ragged"):
        assert runs[name] == whole, name
    sampled = dict(temperature=0.9, top_k=20, sampling="coupled", seed=[5, 6, 7, 8, 9, 10], max_new_tokens=10,
                   batch_size=3, num_draft_tokens=3)
    # coupled sampling: the draft changes nothing, sharded or not
    assert runs["coupled ragged"] == runs["coupled target-only"]
    assert runs["coupled target-only"] == specbatch.generate(target, None, PROMPT_IDS, **sampled).sequences


@pytest.mark.full
def test_float32_sharded_decoding_is_exact_under_the_same_sharding_and_ties_only_against_the_whole_target(tmp_path):
    target, draft, runs = sharded_runs(tmp_path, "llama", torch.float32)
    for name in ("eqspec", "exspec", "ragged"):  # the reference that shares the sharding: exact
        assert runs[name] == runs["target-only"], name
    assert runs["coupled ragged"] == runs["coupled target-only"]
    whole = specbatch.generate(target, None, PROMPT_IDS, max_new_tokens=10, batch_size=1).sequences
    reports = compare(target, PROMPT_IDS, runs["target-only"], whole)  # the all-reduce rounds otherwise
    assert all(r["exact"] or r["kind"] == "tie" for r in reports), reports


def test_a_model_without_a_plan_or_with_heads_that_do_not_divide_is_refused():
    with pytest.raises(TensorParallelError, match=r"GPT2LMHeadModel\) has no tensor-parallel plan"):
        check_shardable(tiny("gpt2"), 2)
    with pytest.raises(TensorParallelError, match="4 attention heads do not divide among 3 ranks"):
        check_shardable(tiny("llama"), 3)
    assert check_shardable(tiny("llama"), 2)["model.layers.0.self_attn.q_proj"] == "colwise"
    with pytest.raises(TensorParallelError, match="does not divide the 3 processes"):
        layout(0, 3, 2)
    groups = [Parallel(rank, 4, 2) for rank in range(4)]  # DP 2 x TP 2: groups of consecutive ranks
    assert [(p.dp_rank, p.tp_rank, p.writes) for p in groups] == [(0, 0, True), (0, 1, False), (1, 0, True),
                                                                    (1, 1, False)]


@pytest.mark.full  # a torchrun launch
def test_the_cli_refuses_a_target_without_a_plan_in_one_line(tmp_path):
    save_folder(tmp_path / "gpt2", tiny("gpt2"))
    (tmp_path / "prompts.txt").write_text("w1 w2\n")
    done = torchrun(2, "-m", "specbatch", "generate", "--target", str(tmp_path / "gpt2"), "--prompts",
                    str(tmp_path / "prompts.txt"), "--tensor-parallel", "2")
    assert done.returncode != 0
    # one error per rank (the two ranks write to one stderr at once: their lines may interleave)
    message = "specbatch generate: error: the target (GPT2LMHeadModel) has no tensor-parallel plan in transformers"
    assert done.stderr.count(message) == 2, done.stderr[-2000:]
    assert "specbatch/tensor_parallel.py" not in done.stderr  # no traceback through specbatch


@pytest.mark.full  # a torchrun launch
def test_verify_under_tensor_parallelism_names_its_reference(folders):
    done = torchrun(2, "-m", "specbatch", "verify", "--target", str(folders / "target"), "--draft",
                    str(folders / "draft"), "--prompts", str(folders / "prompts.jsonl"), "--dtype", "float64",
                    "--max-new-tokens", "8", "--batch-size", "3", "--tensor-parallel", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reference: target-only greedy decoding at batch 1 under the same sharding (tensor parallel 2)" in done.stderr
    assert done.stdout.count(f"exact match: {4 * len(PROMPTS)}/{4 * len(PROMPTS)}") == 1  # rank 0 reports


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    target = tiny("llama", dtype=torch.float64)
    save_folder(root / "target", target)
    save_folder(root / "draft", noisy_copy(target))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS * 4)))
    return root


def generate_args(root, out, *extra):
    return ["-m", "specbatch", "generate", "--target", str(root / "target"), "--draft", str(root / "draft"),
            "--prompts", str(root / "prompts.jsonl"), "--dtype", "float64", "--max-new-tokens", "16",
            "--batch-size", "3", "--policy", "threshold", "--out", str(out), *extra]


@pytest.mark.full  # three launches of 4 processes
def test_data_and_tensor_parallel_write_the_single_process_file_also_after_a_rank_is_killed(folders, tmp_path):
    """DP 2 x TP 2 on 4 processes, its tensor-parallel rank 1 killed mid-way (torchrun stops the
    others), then resumed on 4 processes: the file equals the one a single process writes (both
    launches decode part of the requests, so the file is DP x TP's output throughout)."""
    whole, out = tmp_path / "whole.jsonl", tmp_path / "out.jsonl"
    one = subprocess.run([sys.executable, *generate_args(folders, whole)], capture_output=True, text=True,
                         timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]

    def on_disk() -> int:
        files = [out] + list(tmp_path.glob("out.jsonl.part*"))
        return sum(len(p.read_text().split("\n")[:-1]) for p in files if p.exists())

    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                                 "--master-port", str(free_port()),
                                 *generate_args(folders, out, "--tensor-parallel", "2")],
                                stdout=subprocess.DEVNULL, stderr=open(tmp_path / "killed.log", "w"),
                                start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and on_disk() < 2 and launcher.poll() is None:
        time.sleep(0.02)
    killed = False
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                mine = str(out).encode() in f.read()
        except OSError:
            continue
        if mine and b"RANK=1" in env and pid != launcher.pid:
            os.kill(pid, signal.SIGKILL)  # rank 1: group 0's second rank, mid all-reduce
            killed = True
    assert launcher.wait(timeout=240) != 0 and killed, (tmp_path / "killed.log").read_text()[-3000:]
    written = on_disk()
    assert 2 <= written < 4 * len(PROMPTS)
    resumed = torchrun(4, *generate_args(folders, out, "--tensor-parallel", "2", "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert out.read_bytes() == whole.read_bytes() and not list(tmp_path.glob("out.jsonl.part*"))
