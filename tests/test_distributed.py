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


@pytest.mark.parametrize("sampling", only_full([], ["--temperature", "0.9", "--sampling", "rejection", "--seed", "3"],
                                                ["--temperature", "0.9", "--sampling", "coupled", "--seed", "3"]),
                         ids=["greedy", "rejection", "coupled"])
def test_two_processes_give_the_single_process_file(setup, sampling):
    root, target, draft, prompts = setup
    common = ["generate", "--target", target, "--draft", draft, "--prompts", str(prompts), "--dtype", "float64",
              "--max-new-tokens", "8", "--batch-size", "3", *sampling]
    single, double = root / f"single{len(sampling)}.jsonl", root / f"double{len(sampling)}.jsonl"
    run = lambda *cmd: subprocess.run(cmd, capture_output=True, text=True, timeout=180)  # noqa: E731
    one = run(sys.executable, "-m", "specbatch", *common, "--out", str(single))
    assert one.returncode == 0, one.stderr[-2000:]
    two = run(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
              "-m", "specbatch", *common, "--out", str(double))
    assert two.returncode == 0, two.stderr[-2000:]
    assert double.read_text() == single.read_text()
    assert not list(root.glob(f"double{len(sampling)}.jsonl.part*"))


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
