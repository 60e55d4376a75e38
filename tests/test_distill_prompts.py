"""training/distill_prompts.py: the stage-1 prompts are reproducible, and more of them from another
seed skip an earlier stage's prompts while keeping each prompt's id."""
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("distill_prompts",
                                              Path(__file__).resolve().parents[1] / "training" / "distill_prompts.py")
distill_prompts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(distill_prompts)


def test_excluded_prompts_are_skipped_and_ids_kept():
    earlier = distill_prompts.stage1(seed=0, count=200)
    again = distill_prompts.stage1(seed=0, count=200)
    assert earlier == again and len({p["prompt"] for p in earlier}) == 200
    more = distill_prompts.stage1(seed=1, count=300)
    excluded = frozenset(p["prompt"] for p in earlier) | {more[0]["prompt"], more[5]["prompt"]}
    fresh = distill_prompts.stage1(seed=1, count=100, exclude=excluded, id_prefix="s3-")
    assert len(fresh) == 100 and not {p["prompt"] for p in fresh} & excluded
    by_text = {p["prompt"]: p["id"] for p in more}
    assert all(p["id"] == "s3-" + by_text[p["prompt"]] for p in fresh)  # same number as without the exclusion
    assert fresh[0]["prompt"] == more[1]["prompt"] or more[1]["prompt"] in excluded
