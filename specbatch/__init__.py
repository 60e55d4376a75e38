"""specbatch: batch speculative decoding that is provably output-equivalent.

`specbatch.generate` (torch engine), `specbatch.load` (a target and draft by name),
`specbatch.GenerateOptions` (every default), `specbatch.STRATEGIES` (name -> strategy class),
`specbatch.release_buffers` (the K/V buffers kept between generations),
`specbatch.reference` (NumPy reference), `specbatch.invariants` (checkers and trace format),
`specbatch.fast` (the torch engine's parts).
Every exception specbatch raises on purpose is a `specbatch.SpecbatchError`.
"""
from .errors import SpecbatchError, UserError
from .options import GenerateOptions

__version__ = "0.1.0"
__all__ = ["generate", "load", "GenerateOptions", "GenerationResult", "STRATEGIES", "SpecbatchError", "UserError",
           "release_buffers"]


def __getattr__(name):  # import torch only when the torch engine is used
    if name in ("generate", "STRATEGIES"):
        from . import api
        return getattr(api, name)
    if name == "load":
        from .prepare import load
        return load
    if name == "release_buffers":
        from .fast.compute.slot_cache import release_buffers
        return release_buffers
    if name == "GenerationResult":
        from .fast.engine import GenerationResult
        return GenerationResult
    raise AttributeError(f"module 'specbatch' has no attribute {name!r}")
