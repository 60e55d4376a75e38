"""Shared test setup: the two profiles (tests/profiles.py), tiny model folders and a prompt file
for the CLI tests.

`pytest --device cuda` (or SPECBATCH_TEST_DEVICE=cuda): the engine's tests on that device (the
modules of DEVICE_MODULES; the others test the CPU, files and the command line and are deselected).

`pytest`: the default profile (Hypothesis "quick", the pairwise subset of every grid, no tests
marked `full`). `pytest --full`: the full pre-merge profile (Hypothesis "full", every case, every
test). HYPOTHESIS_PROFILE=thorough (or quick / full) picks the Hypothesis profile by itself.
"""
import json
import os

import pytest
from hypothesis import HealthCheck, settings

# the test modules that run on any device: equivalence, invariants, properties, sampling, drafts, conformance
DEVICE_MODULES = {"test_backend", "test_fast_engine", "test_bfloat16", "test_sampling", "test_invariants",
                  "test_proposals", "test_conform"}

for name, count in (("quick", 10), ("full", 60), ("thorough", 400)):
    settings.register_profile(name, max_examples=count, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="specbatch: the full pre-merge profile (every case of "
                     "every grid, the tests marked full, Hypothesis's full example counts)")
    parser.addoption("--device", default=os.environ.get("SPECBATCH_TEST_DEVICE") or "cpu",
                     help="specbatch: the device the engine's tests run on: cpu (default; every test), cuda, "
                     "cuda:1, ... (the modules of conftest.DEVICE_MODULES); default $SPECBATCH_TEST_DEVICE or cpu")


def pytest_configure(config):
    import torch
    device = config.getoption("--device")
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise pytest.UsageError(f"--device {device!r} is not a device torch knows (cpu, cuda, cuda:1, ...)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {device}: CUDA is not available to this torch ({torch.__version__})")
    os.environ["SPECBATCH_TEST_DEVICE"] = device  # read by hf_models.tiny
    from specbatch.fast.compute import row_plan  # row counts measured in tests stay in memory, off the user's cache
    plans = row_plan.RowPlans(None, row_plan.machine_key())
    # tests run oneDNN's packed kernel wherever it packs, not whichever kernel a tiny model's timing
    # favours (tests/test_kernels.py measures and exercises the choice with plans of its own)
    plans.plain_for = lambda key, rows, time_step: False
    row_plan._PLANS = plans
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("full" if config.getoption("--full") else "quick"))


def pytest_collection_modifyitems(config, items):
    if config.getoption("--device") != "cpu":
        off = [item for item in items if item.module.__name__.rpartition(".")[2] not in DEVICE_MODULES]
        if off:
            config.hook.pytest_deselected(items=off)
            items[:] = [item for item in items if item not in off]
    if config.getoption("--full"):
        return
    kept = [item for item in items if item.get_closest_marker("full") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("full")])
        items[:] = kept


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Saved tiny model folders with a word-level tokenizer: target, draft, and one of another vocabulary."""
    import torch

    from hf_models import VOCAB, save_folder, tiny
    root = tmp_path_factory.mktemp("models")
    return dict(target=save_folder(root / "target", tiny("llama", dtype=torch.float32)),
                draft=save_folder(root / "draft", tiny("llama", layers=1, seed=9, dtype=torch.float32)),
                other=save_folder(root / "other", tiny("llama", layers=1, seed=9, dtype=torch.float32,
                                                       vocab_size=VOCAB + 4)))


@pytest.fixture(scope="session")
def greedy_vectors(tmp_path_factory):
    """Conformance vectors for tiny("llama") (float64), made once per session: a folder."""
    from hf_models import tiny
    from specbatch.conformance.greedy import make_vectors
    folder = tmp_path_factory.mktemp("vectors")
    make_vectors(tiny("llama"), folder, max_context=120)
    return folder


@pytest.fixture()
def prompt_file(tmp_path):
    """The CLI's test prompts (hf_models.PROMPTS) as JSONL with ids q0, q1, ..."""
    from hf_models import PROMPTS
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return path
