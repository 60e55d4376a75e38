"""Public name of the conformance kit's engine protocol, adapters and pytest plugin.

The code lives in `specbatch.conformance.testing`; this name is the same module object.
"""
import sys

from .conformance import testing as _testing

sys.modules[__name__] = _testing
