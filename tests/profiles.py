"""Example counts that follow the Hypothesis profile (tests/conftest.py registers the profiles)."""
from hypothesis import settings


def examples(quick: int) -> int:
    """Examples for a slow property: `quick` under the default profile (max_examples 40), scaled by
    the loaded profile's max_examples (x10 under HYPOTHESIS_PROFILE=thorough)."""
    return max(quick, quick * settings.default.max_examples // 40)
