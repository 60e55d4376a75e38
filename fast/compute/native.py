"""The lean forward's block loop in C++, for the ragged strategy's decode and verify steps, and the
element-wise kernels of every lean forward.

At batch 1 a decoding step of SmolLM2-135M runs about 40 small operators a layer between its four
products, and the Python interpreter around them costs about as much again as the operators
themselves. native_blocks.cpp runs the lean forward's 30 blocks (fast.compute.lean_llama) for a flat
forward (fast.compute.attention.flat_attention over a SlotCache) as one C++ call: the same operators
in the same order on the same operands as the Python loop, so its output is bitwise the Python
loop's (tests/test_native_blocks.py). Everything that depends on the forward is decided here in
Python, once per forward instead of once per layer: each product's row plan (fast.compute.kernels),
the flat attention's parts, and the cache slots the new keys and values go to.

Three of a block's steps are kernels of their own (`element_ops`): the RMS norm, the rotation and the
SiLU product, each one pass per row where torch runs 3-8 operators and their temporaries (torch's
rms_norm is composite on the CPU). Both loops use them whenever the extension is built, so the two
stay bitwise equal; each row is computed alone in an order that does not depend on the row count,
so a row's result is the same in a decode step and in a verify (I8). They equal torch's steps up
to rounding (tests/test_native_blocks.py). The build uses the vector instructions torch found on
the CPU (`compile_flags`).

The extension is compiled by torch.utils.cpp_extension with the machine's C++ compiler the first time
a process needs it (about 30 seconds on 2 cores), and kept in the specbatch cache folder
($SPECBATCH_CACHE/native, one build per source, torch and Python version), so a machine compiles it
once. Where it cannot be built (no compiler or no ninja), the lean forward runs its blocks in Python
and says so once. `generate(..., native=False)` (`--no-native`) runs them in Python anyway;
SPECBATCH_NATIVE=0 in the environment turns the native path off for the whole process.
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
import warnings
import weakref
from pathlib import Path

import torch

from . import kernels
from .attention import current_plan
from .kernels import PackedForward
from .row_plan import PLAIN
from .slot_cache import SlotCache

SOURCE = Path(__file__).with_name("native_blocks.cpp")
ENABLED = os.environ.get("SPECBATCH_NATIVE", "1") != "0"

_LOCK = threading.Lock()
_BUILT: dict = {}  # "module": the extension, or None where it cannot be built
_LISTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # decoder -> (key, _block_lists' answer)


def compile_flags(threads: bool = True) -> list[str]:
    """-O3, the vector instructions torch uses on this CPU (its CPU capability), so that the
    element-wise kernels' loops vectorize as wide as torch's own, and (threads) OpenMP where torch
    uses it, so that at::parallel_for shares a prefill's rows among torch's threads (without it,
    at::parallel_for runs on one)."""
    isa = {"AVX512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"],
           "AVX2": ["-mavx2", "-mfma"]}.get(torch.backends.cpu.get_cpu_capability(), [])
    openmp = ["-fopenmp"] if threads and torch.backends.openmp.is_available() else []
    return ["-O3", "-fno-math-errno", "-fno-trapping-math", *isa, *openmp]  # no errno or traps: exp vectorizes


def build_name(threads: bool = True) -> str:
    """The extension's name: one per source, flags, torch version, Python version and environment
    (sys.prefix: two virtual environments sharing the cache folder would otherwise rebuild one
    folder in turn, each seeing the other's build arguments, some 30 s inside a first generation)."""
    tag = hashlib.sha256(SOURCE.read_bytes() + " ".join(compile_flags(threads)).encode()
                         + torch.__version__.encode() + sys.version.encode() + sys.prefix.encode()).hexdigest()[:12]
    return f"specbatch_native_{tag}"


def extension():
    """The compiled extension (built on first use, then loaded from the cache folder), or None where
    this machine cannot build it or the environment turned it off."""
    if not ENABLED:
        return None
    if "module" not in _BUILT:
        with _LOCK:
            if "module" not in _BUILT:
                _BUILT["module"] = _build()
    return _BUILT["module"]


def _build():
    """The extension with OpenMP where torch has it, else (a compiler without it, such as Apple's
    clang) without; None, with one warning, where neither builds."""
    from torch.utils import cpp_extension

    from ..loading import cache_dir
    for threads in (True, False) if torch.backends.openmp.is_available() else (False,):
        name = build_name(threads)
        folder = cache_dir() / "native" / name
        flags = compile_flags(threads)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if not any(folder.glob(f"{name}*.so")):
                print("specbatch: compiling the native block loop (once per machine and torch version, about 30 s)",
                      file=sys.stderr)
            return cpp_extension.load(name, [str(SOURCE)], extra_cflags=flags, build_directory=str(folder),
                                      extra_ldflags=[f for f in flags if f == "-fopenmp"], verbose=False)
        except Exception as error:  # no compiler, ninja, headers or OpenMP, an unwritable cache
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    warnings.warn(f"specbatch: the native block loop could not be built here ({reason}); "
                  "the lean forward runs its blocks in Python", RuntimeWarning, stacklevel=2)
    return None


ELEMENT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def element_ops(hidden: torch.Tensor):
    """The extension's element-wise kernels (rms_norm, rotate, silu_mul: fast.compute.lean_llama.TorchOps'
    three steps) for blocks over `hidden`, or None where they do not apply (not on the CPU, a dtype
    they do not take, or no extension)."""
    if hidden.device.type != "cpu" or hidden.dtype not in ELEMENT_DTYPES:
        return None
    return extension()


def _forward(module: torch.nn.Linear):
    """module's forward as the lean forward calls it: its class's (None), a PackedForward while
    prepacked (fast.compute.kernels), or something else (False: the native loop cannot reproduce it)."""
    forward = vars(module).get("forward")
    return forward if forward is None or isinstance(forward, PackedForward) else False


def _plan(module: torch.nn.Linear, rows: int, dtype):
    """row_plan.product's plan for module's product of `rows` rows, as its forward decides it."""
    forward = _forward(module)
    if forward is False:
        return None
    return PLAIN if forward is None else forward.plan(rows, dtype)


def _parts(parts) -> tuple[list, list]:
    """The flat attention's parts as flat_blocks takes them: five integers (row run start and stop,
    or -1 and -1 for gathered rows; slots read; query run start and stop, or -1 and -1) and five
    tensors (row index, query tokens, mask, cells, targets) each."""
    empty = torch.empty(0, dtype=torch.long)
    ints, tensors = [], []
    for part in parts:
        rows = (part.rows.start, part.rows.stop) if isinstance(part.rows, slice) else (-1, -1)
        run = (part.run.start, part.run.stop) if part.run is not None else (-1, -1)
        ints += [*rows, part.length, *run]
        tensors += [empty if isinstance(part.rows, slice) else part.rows, part.tokens, part.mask, part.cells,
                    part.targets]
    return ints, tensors


def _gather(decoder):
    """Per kind of product (q/k/v, output, gate/up, down) the first block's module, and per block its
    norm weights, weights and the weights its products read (packed, or the weight itself); None
    where a block's product is one the C++ loop cannot reproduce, or is prepacked unlike the first
    block's (one shape class per kind)."""
    kinds = lambda block: (block.qkv, block.o, block.gate_up, block.down)  # noqa: E731
    first = decoder.blocks[0]
    unpacked = [_forward(linear) is None for linear in kinds(first)]
    norms, weights, packed = [], [], []
    for block in decoder.blocks:
        for linear, plain in zip(kinds(block), unpacked):
            forward = _forward(linear)
            if forward is False or (forward is None) != plain:
                return None  # a forward replaced by something else, or prepacked unlike the first block's
            packed.append(linear.weight if forward is None else forward.packed)
        norms += [block.attention_norm, block.mlp_norm]
        weights += [block.qkv.weight, block.o.weight, block.gate_up.weight, block.down.weight]
    return kinds(first), norms, weights, packed


def _block_lists(decoder):
    """_gather(decoder), made once per decoder and kept while no forward was swapped since
    (kernels.swaps(): a weight changed in place is repacked at the next swap) and its first block
    holds the same weight."""
    key = (kernels.swaps(), len(decoder.blocks), id(decoder.blocks[0].qkv.weight))
    cached = _LISTS.get(decoder)
    if cached is None or cached[0] != key:
        cached = (key, _gather(decoder))
        _LISTS[decoder] = cached
    return cached[1]


def flat_blocks(decoder, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, cache):
    """decoder's blocks (fast.compute.lean_llama.LeanLlama) over `hidden` [1, T, width] in one C++ call,
    bitwise what its Python loop computes; None where this forward is not one the C++ loop runs (not a
    flat forward over an initialised SlotCache on the CPU, a product it cannot reproduce, or no
    extension), and the caller runs the Python loop."""
    plan = current_plan()
    if plan.flat is None or plan.fused or not isinstance(cache, SlotCache) or cache.packed \
            or hidden.device.type != "cpu" or len(cache.layers) != len(decoder.blocks) \
            or not all(layer.is_initialized for layer in cache.layers):
        return None
    module = extension()
    lists = _block_lists(decoder) if module is not None else None
    if lists is None:
        return None
    firsts, norms, weights, packed = lists
    rows = hidden.shape[0] * hidden.shape[1]
    plans = [_plan(linear, rows, hidden.dtype) for linear in firsts]  # one shape class per kind
    if None in plans:
        return None
    keys = [layer.keys for layer in cache.layers]
    values = [layer.values for layer in cache.layers]
    write = cache.flat_index(keys[0].shape[1], keys[0].shape[2])
    ints, tensors = _parts(plan.flat)
    first = decoder.blocks[0]
    return module.flat_blocks(hidden, cos, signed_sin, norms, weights, packed, plans, keys, values, write,
                              cache.rows, cache.kv_len, first.heads, first.kv_heads, first.head_dim, first.eps,
                              first.scaling, plan.sdpa, ints, tensors)
