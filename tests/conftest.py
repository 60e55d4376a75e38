"""Shared test setup: Hypothesis profiles; tiny model folders and a prompt file for the CLI tests.

default: quick, for every CI run. thorough: many more examples (HYPOTHESIS_PROFILE=thorough).
"""
import json
import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


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
