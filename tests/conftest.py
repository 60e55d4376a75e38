"""Shared test setup: the two profiles (tests/profiles.py), tiny model folders and a prompt file
for the CLI tests.

`pytest`: the default profile (Hypothesis "quick", the pairwise subset of every grid, no tests
marked `full`). `pytest --full`: the full pre-merge profile (Hypothesis "full", every case, every
test). HYPOTHESIS_PROFILE=thorough (or quick / full) picks the Hypothesis profile by itself.
"""
import json
import os

import pytest
from hypothesis import HealthCheck, settings

for name, count in (("quick", 10), ("full", 60), ("thorough", 400)):
    settings.register_profile(name, max_examples=count, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="specbatch: the full pre-merge profile (every case of "
                     "every grid, the tests marked full, Hypothesis's full example counts)")


def pytest_configure(config):
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("full" if config.getoption("--full") else "quick"))


def pytest_collection_modifyitems(config, items):
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


@pytest.fixture()
def prompt_file(tmp_path):
    """The CLI's test prompts (hf_models.PROMPTS) as JSONL with ids q0, q1, ..."""
    from hf_models import PROMPTS
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return path
