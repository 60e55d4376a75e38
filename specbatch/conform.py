"""Public name of the greedy conformance vectors and their checker.

The code lives in `specbatch.conformance.greedy`; this name is the same module object.
"""
import sys

from .conformance import greedy as _greedy

sys.modules[__name__] = _greedy
